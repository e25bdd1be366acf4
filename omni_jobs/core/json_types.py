"""Names for JSON-shaped data: a job's input and parameters, its events' data, webhook bodies,
stored records.

Such a value came from JSON (a request body, a Redis field, a YAML file) or goes to JSON, and
nothing more is known of its shape: code that reads one narrows it (``isinstance``) rather than
trusting it. Data with a fixed shape gets a model or a TypedDict instead.

``JsonValue`` is pydantic's: in a model it validates that a value is JSON (dicts with string keys,
lists, strings, numbers, booleans, None); to mypy it is the recursive union of those.
"""

from __future__ import annotations

from typing import TypeAlias

from pydantic import JsonValue

__all__ = ["JsonObject", "JsonScalar", "JsonValue"]

JsonScalar: TypeAlias = str | int | float | bool | None
"""A JSON value that is not a container (a flat object's values: a stage's parameters)."""

JsonObject: TypeAlias = dict[str, JsonValue]
"""A JSON object: what a job's input and an event's data are."""

