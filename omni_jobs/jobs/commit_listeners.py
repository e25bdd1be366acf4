"""Who hears of the job ledger's commits in this process: the job and stage metrics, the usage tally.

The process shells install them (``metrics.install``, ``usage.install``) and the runtime's ledger hands
each commit's job and events here. This is the job layer's own hook, apart from ``telemetry``, which
sits below the job layer and so knows no ``Job``. A listener never fails the commit: what it raises is
logged and dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from omni_jobs.jobs.models import Job, JobEvent

log = logging.getLogger(__name__)

CommitListener = Callable[[Job, list[JobEvent]], None]

_listeners: list[CommitListener] = []
_lock = threading.Lock()


def add(listener: CommitListener) -> None:
    """Hand this process's commits to ``listener`` too (once: adding an equal one again does nothing)."""
    with _lock:
        if listener not in _listeners:
            _listeners.append(listener)


def remove(listener: CommitListener) -> None:
    with _lock:
        _listeners[:] = [existing for existing in _listeners if existing != listener]


def committed(job: Job, events: list[JobEvent]) -> None:
    """The ledger listener that the runtime installs: hands each commit's events to the listeners."""
    for listener in tuple(_listeners):
        try:
            listener(job, events)
        except Exception:
            log.exception("job commit listener %r failed", listener)
