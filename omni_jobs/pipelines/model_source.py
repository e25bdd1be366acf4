"""Model ids the core does not know itself: sources registered by prefix.

The core loads a model from a local path or a hub id, unchanged. Other ids name a *source* that
resolves them to a local path: ``tiny:NAME`` is the random-weight model that the tests and the
demo use, built on first use by the tooling (omni_jobs.local.tiny). The core never imports a
source: a source registers itself here (``register_model_source``), and the modules named in
``Settings.model_sources`` (``OMNI_MODEL_SOURCES``, default ``["omni_jobs.local.tiny"]``) are
loaded by name: by the process shells at start-up (the workers, the API: the embedded system
runs both), by ``Omni`` when it is made, and in any other process (a test, a benchmark) at the
first id with an unknown prefix.
A plugin module defines ``register_model_sources() -> None``.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from omni_jobs.core.json_types import JsonValue

_PREFIX = re.compile(r"^([a-z][a-z0-9_-]*:)(?!//)")
"""``name:`` at the start of a model id (not a URL scheme, not a Windows drive letter: those fail the pattern or have ``//``)."""


def _no_facts(name: str) -> Mapping[str, JsonValue]:
    return {}


@dataclass(frozen=True)
class ModelSource:
    prefix: str
    """The id prefix this source owns, with its colon (``"tiny:"``)."""
    resolve: Callable[[str, Path], str]
    """(name after the prefix, models directory) -> a local path, building the model if needed."""
    facts: Callable[[str], Mapping[str, JsonValue]] = field(default=_no_facts)
    """name -> what is known before building: ``hidden_size``, ``prompt_embed_dim``, ``embed_key``,
    ``text_encoder`` (pipeline validation checks that sizes agree across a wire)."""


_SOURCES: dict[str, ModelSource] = {}
_LOADED: set[str] = set()
_LOCK = threading.Lock()


def register_model_source(source: ModelSource) -> None:
    """Register (or replace) the source of the ids that start with ``source.prefix``."""
    with _LOCK:
        _SOURCES[source.prefix] = source


def load_model_sources(modules: Iterable[str]) -> None:
    """Import each plugin module once and call its ``register_model_sources()``."""
    for name in modules:
        with _LOCK:
            if name in _LOADED:
                continue
        importlib.import_module(name).register_model_sources()
        with _LOCK:
            _LOADED.add(name)


def _source_for(model: str) -> tuple[ModelSource, str] | None:
    match = _PREFIX.match(model)
    if match is None:
        return None
    prefix = match.group(1)
    if prefix not in _SOURCES:
        from omni_jobs.core.settings import get_settings

        load_model_sources(get_settings().model_sources)
    source = _SOURCES.get(prefix)
    return (source, model[len(prefix):]) if source is not None else None


def resolve_model(model: str, models_dir: Path) -> str:
    """A registered source's id -> its local path (built if needed); a path or hub id unchanged."""
    found = _source_for(model)
    if found is None:
        return model
    source, name = found
    return source.resolve(name, Path(models_dir))


def source_facts(model: str) -> Mapping[str, JsonValue] | None:
    """What a registered source knows about ``model`` without building it; None for a path or hub id."""
    found = _source_for(model)
    if found is None:
        return None
    source, name = found
    return source.facts(name)
