"""Reading redis-py's replies as text.

The core's Redis clients do not decode replies (artifacts and cached outputs are bytes), so a
reply's strings arrive as bytes; redis-py types them ``bytes | str`` (a client may decode), and a
sorted-set read as members or (member, score) pairs. These narrow a reply to what was asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def text(value: bytes | str | int) -> str:
    """One string (or a number) of a reply, as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def members(reply: Iterable[object]) -> list[str]:
    """The members a set or sorted-set read answers, read without scores (each one a string)."""
    return [text(m) for m in reply if isinstance(m, bytes | str)]


def text_hash(reply: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """HGETALL's answer with text fields and values."""
    return {text(k): text(v) for k, v in reply.items()}
