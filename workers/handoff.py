"""Celery's consumer hands each task to its thread before it goes on.

A threads-pool worker's consumer thread puts a task on the pool's queue, and then goes on with its
own work (the task events, its next read from the broker) while holding the GIL: the task's thread,
woken, waits for it (0.35-0.45 ms of every hop, measured with timestamps at the handoff and at the
task's start; up to the switch interval). A short pause right after the handoff
(``OMNI_WORKER_HANDOFF_MS``) gives the GIL to the task's thread, which then runs until its first
write to Redis, the stage's start. The consumer's own work waits for that: the pause, then until
that thread lets go of the GIL (a burst of 64 tasks: about 13 ms of pauses in all, spent while those
tasks start). Every threads-pool worker does it (stages, results, webhooks); the in-process runner
has no consumer and is not concerned.
"""

from __future__ import annotations

import time
from typing import Any


def install(pause_ms: float) -> None:
    """Pause ``pause_ms`` after every task the threads pool is given (0: no pause)."""
    from celery.concurrency import thread

    pool = thread.TaskPool
    original = getattr(pool.on_apply, "_omni_original", pool.on_apply)
    if pause_ms <= 0:
        pool.on_apply = original  # type: ignore[method-assign]
        return
    pause_s = pause_ms / 1000

    def on_apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        applied = original(self, *args, **kwargs)
        time.sleep(pause_s)  # the GIL goes to the task's thread, just woken
        return applied

    on_apply._omni_original = original  # type: ignore[attr-defined]
    pool.on_apply = on_apply  # type: ignore[method-assign]
