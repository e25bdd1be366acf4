"""What the core reports about its own work, for whoever listens.

Engines, the engine pool, the stage-output cache and the artifact store report here (a batch of
``size`` requests, a cache hit or miss, an engine load, bytes put or got); they import nothing about
how it is counted. A job commit's events have their own hook in the job layer
(``omni_jobs.jobs.commit_listeners``). The process shells install the
listeners: the API and the workers install Prometheus (``omni_jobs.report.metrics.install``), and an
in-process ``Omni`` counts nothing unless its caller installs it too. A listener never fails the
caller: what it raises is logged and dropped.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class Listener:
    """Override what you count; each method does nothing by default."""

    def batch(self, engine: str, size: int) -> None:
        """One engine call with ``size`` requests (``engine``: ar, ar-encode, dit)."""

    def batch_ran(self, batcher: str, waited_s: float, run_s: float) -> None:
        """A batcher's batch ran for ``run_s``, after its first request had waited ``waited_s`` for it
        (``batcher``: dit, ar)."""

    def cache_lookup(self, cache: str, hit: bool) -> None:
        """One lookup in a named cache (``engine``: the engine pool; ``stage``: the stage-output cache)."""

    def engine_load(self, engine: str, seconds: float) -> None:
        """An engine of kind ``engine`` took ``seconds`` to load."""

    def engine_restart(self, engine: str) -> None:
        """An engine process of kind ``engine`` crashed and was started again."""

    def artifact_io(self, backend: str, op: str, size: int) -> None:
        """``size`` bytes moved to (``put``) or from (``get``) an artifact backend."""


_listeners: list[Listener] = []
_lock = threading.Lock()


def add_listener(listener: Listener) -> None:
    """Install ``listener`` in this process (once: adding the same object again does nothing)."""
    with _lock:
        if all(existing is not listener for existing in _listeners):
            _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    with _lock:
        _listeners[:] = [existing for existing in _listeners if existing is not listener]


def _each(call: str, *args: object) -> None:
    for listener in tuple(_listeners):
        try:
            getattr(listener, call)(*args)
        except Exception:
            log.exception("telemetry listener %r failed on %s", listener, call)


def batch(engine: str, size: int) -> None:
    _each("batch", engine, size)


def batch_ran(batcher: str, waited_s: float, run_s: float) -> None:
    _each("batch_ran", batcher, waited_s, run_s)


def cache_lookup(cache: str, hit: bool) -> None:
    _each("cache_lookup", cache, hit)


def engine_load(engine: str, seconds: float) -> None:
    _each("engine_load", engine, seconds)


def engine_restart(engine: str) -> None:
    _each("engine_restart", engine)


def artifact_io(backend: str, op: str, size: int) -> None:
    _each("artifact_io", backend, op, size)

