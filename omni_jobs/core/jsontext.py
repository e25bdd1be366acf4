"""Compact JSON text for what every request writes and reads: a job's stored fields, a Change's
wire form, outbox items, the API's job answers.

orjson, not the standard library: in the API's submit path the standard encoder was about a tenth
of the CPU (four documents per submit), orjson takes ~1/10 of that (bench.submit). Its output is
standard JSON, so every reader (Lua's cjson, json.loads, clients) reads it unchanged. Where orjson
refuses a value (an integer past 64 bits, a key that is not a string, a type it does not know) the
standard library writes it as before. NaN and the infinities, which standard JSON cannot say, are
written as null (the standard library wrote the non-standard tokens NaN/Infinity); ``loads`` still
reads such tokens in text written before.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

_SORTED = orjson.OPT_SORT_KEYS


def dumps(value: object, *, sort_keys: bool = False) -> str:
    """``json.dumps(value, separators=(",", ":"), ensure_ascii=False)``, fast."""
    return dumps_bytes(value, sort_keys=sort_keys).decode()


def dumps_bytes(value: object, *, sort_keys: bool = False) -> bytes:
    """UTF-8 JSON, for a response body or a Redis value."""
    try:
        return orjson.dumps(value, option=_SORTED if sort_keys else None)
    except TypeError:
        # \u escapes: also a lone surrogate (from a JSON \ud83d escape) has a spelling
        return json.dumps(value, separators=(",", ":"), sort_keys=sort_keys).encode()


MAX_DEPTH = 1024
"""orjson's limit on nesting. The standard library has none of its own: past the interpreter's
recursion limit it raises RecursionError, which no caller expects (a request's body became a 500)."""


def loads(text: str | bytes) -> Any:  # as json.loads: the caller knows the shape
    """The value of JSON text (also text with NaN/Infinity tokens, as the standard library wrote).
    Text nested deeper than MAX_DEPTH is a JSONDecodeError saying so, never a RecursionError."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        if exc.msg.startswith("depth limit"):  # not worth the standard library's second read
            raise json.JSONDecodeError(f"nested too deep (at most {MAX_DEPTH} levels)", exc.doc, exc.pos) from None
        return json.loads(text)
