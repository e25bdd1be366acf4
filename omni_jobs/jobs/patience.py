"""Waiting out a job store outage: a step's state writes are retried until Redis answers again.

A worker that computed a stage's outputs should record them when Redis comes back, not lose them
because Redis restarted meanwhile. Every ledger write is guarded and idempotent (a retried write
that had in fact been applied is recognised), so retrying is always safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from omni_jobs.core.errors import StoreUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
STORE_DOWN: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError)


def while_store_down(call: Callable[[], T], *, wait_s: float, what: str) -> T:
    """``call()``, retried with backoff (0.1 s doubling to 2 s) while Redis is unreachable, for up
    to ``wait_s``; then StoreUnavailable."""
    started = time.monotonic()
    delay = 0.1
    warned = False
    while True:
        try:
            result = call()
        except STORE_DOWN as exc:
            waited = time.monotonic() - started
            if waited >= wait_s:
                raise StoreUnavailable(what, waited, exc) from exc
            if not warned:
                log.warning("%s: the job store is unreachable (%s); retrying for up to %.0fs", what, exc, wait_s)
                warned = True
            time.sleep(min(delay, max(0.0, wait_s - waited)))
            delay = min(delay * 2, 2.0)
            continue
        if warned:
            log.info("%s: the job store answers again after %.1fs", what, time.monotonic() - started)
        return result
