"""A cached property built once per instance, even when threads race for its first read.

``functools.cached_property`` serialized first reads before Python 3.12 and no longer does: since
3.12 every thread that reads it before the first build ends runs the builder, and the last result
wins. The runtime's components own threads, connection pools and semaphores (a worker's first burst
of tasks reads them from 64 threads at once), so two of one split what must be shared: seen on a
GPU host under 3.12, where one burst built a webhook deliverer (and its TLS context) per thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, Self, TypeVar, overload

T = TypeVar("T")

_LOCKS = "_once_property_locks"
_guard = threading.Lock()


class once_property(Generic[T]):
    """Like ``functools.cached_property`` (the value lands in the instance's ``__dict__``, so later
    reads never reach this descriptor, and ``del obj.name`` builds it again), with a lock per
    instance and name around the build: one build, whoever reads first. Re-entrant, so a builder
    may read the other properties of its instance."""

    def __init__(self, build: Callable[[Any], T]) -> None:
        self.build = build
        self.name = build.__name__
        self.__doc__ = build.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Self: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> T | Self:
        if obj is None:
            return self
        values = obj.__dict__
        if self.name in values:
            return values[self.name]  # type: ignore[no-any-return]  # the instance dict holds object; the builder gave it type T
        with _lock(obj, self.name):
            if self.name not in values:
                values[self.name] = self.build(obj)
            return values[self.name]  # type: ignore[no-any-return]  # the instance dict holds object; the builder gave it type T


def _lock(obj: object, name: str) -> threading.RLock:
    with _guard:
        locks: dict[str, threading.RLock] = obj.__dict__.setdefault(_LOCKS, {})
        return locks.setdefault(name, threading.RLock())
