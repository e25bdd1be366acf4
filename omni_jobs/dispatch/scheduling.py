"""Scheduling: which waiting stage a queue's workers get next, and who may submit how much.

A stage's first attempt does not go to the broker when it becomes runnable. It waits in its
tenant's ready list on its queue, ordered by queued time moved by priority (JobLedger.order: high
goes ``priority_aging_s`` ahead, low as far back, so nothing starves). The ``Scheduler`` releases
ready stages to the broker only while fewer than the queue's *window* are released or running: the
live workers' concurrency plus ``slack`` (so a freed slot finds its next task waiting). Tenants
take turns, the one served longest ago first, so one tenant's backlog cannot hold the others back:
while the window is full, every other tenant with ready work is served before it gets another.
Every relay runs a pass before it publishes (after its own commits, where a slot may be free, and
every poll), one atomic script for all queues. Retries and lost workers' requeues keep their place: they go out directly.

``Quotas`` are checked in the submit's own atomic write (omni_jobs.jobs.ledger): jobs a tenant has
queued or running at once, and jobs it submits per minute; per API key, else per tenant, else the
settings' defaults. A breach answers 429 with Retry-After and names the limit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from omni_jobs.core import keys
from omni_jobs.jobs.change import Change, ReleasePass
from omni_jobs.jobs.ledger import Quota
from omni_jobs.jobs.models import now
from omni_jobs.jobs.store import JobStore

Capacity = Callable[[], dict[str, int]]
"""queue -> how many tasks its live workers run at once (omni_jobs.dispatch.worker_registry.queue_capacity)."""

UNLIMITED = 1 << 30


class Scheduler:
    def __init__(self, store: JobStore, capacity: Capacity | None, *, slack: int = 2, refresh_s: float = 1.0) -> None:
        """``capacity``: None releases everything at once (one process: Omni drains its own outbox)."""
        self.store = store
        self.capacity = capacity
        self.slack = slack
        self.refresh_s = refresh_s
        self._cached: tuple[float, dict[str, int]] = (0.0, {})
        self._full: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    def _capacity(self, read: Capacity) -> dict[str, int]:
        """The live workers' concurrency per queue, read at most every ``refresh_s``."""
        with self._lock:
            at, capacity = self._cached
            if time.monotonic() - at > self.refresh_s:
                capacity = read()
                self._cached = (time.monotonic(), capacity)
        return capacity

    def windows(self) -> dict[str, int]:
        """Queue -> its window, the steps it may have released or running at once: its live workers'
        concurrency plus ``slack`` (every scheduled queue, unbounded, without ``capacity``)."""
        if self.capacity is None:
            return dict.fromkeys(self.store.scheduled_queues(), UNLIMITED)
        return {queue: n + self.slack for queue, n in self._capacity(self.capacity).items() if n > 0}

    def passed(self, done: ReleasePass) -> None:
        """Note what a pass found (the queues it left full: may_release)."""
        self._full = done.full

    def windows_for(self, change: Change) -> dict[str, int] | None:
        """The windows of the queues where ``change`` makes a step ready or frees a place, for the
        pass a store runs in the commit itself (RedisJobStore.publish_in_commit), from the capacity
        last read (no read here: a commit does not wait on the worker registry); None before the
        first read (the relay's pass then does it). A queue with no live worker, or whose window the
        last pass left full and this change frees nothing of, is left out: nothing could go out there."""
        read_at, capacity = self._cached
        if self.capacity is None or read_at == 0.0:
            return None
        full = self._full
        queues = {step.queue for step in change.scheduled} | change.freed
        return {queue: capacity[queue] + self.slack for queue in queues
                if capacity.get(queue, 0) > 0 and (queue in change.freed or queue not in full)}

    def passed_in_commit(self, change: Change) -> None:
        """Note what the pass of a commit found (``change.passed``), for its queues only."""
        if change.passed is not None:
            self._full = (self._full - change.passed.queues) | change.passed.full

    def release_all(self) -> int:
        """One pass over every queue with live workers (one script); returns how many steps it released.
        (The relay runs the same pass and its claim in one script: JobStore.release_and_claim.)"""
        windows = self.windows()
        done = self.store.release(windows, now=now()) if windows else ReleasePass([], frozenset())
        self.passed(done)
        return len(done.released)

    def may_release(self, queues: Collection[str]) -> bool:
        """Whether a pass now could release a step that just became ready on one of ``queues``: not
        when no live worker takes them (nothing could run it; a worker that starts runs a pass), nor
        when this scheduler's last pass left their windows full (the process whose commit frees a
        slot runs the next pass; every relay's poll runs one anyway). So a burst of submits to a busy
        or idle queue does not run a pass each."""
        read_at, capacity = self._cached
        if self.capacity is None or read_at == 0.0:  # one process, or no pass yet: it may
            return True
        full = self._full
        return any(capacity.get(queue, 0) > 0 and queue not in full for queue in queues)


@dataclass(frozen=True)
class QuotaDefaults:
    max_active: int = 0
    per_minute: int = 0


class Quotas:
    """The limits of a submit: the API key's own, else its tenant's, else the defaults (0: none)."""

    def __init__(self, read: Callable[[str], dict[str, str]], defaults: QuotaDefaults, *, cache_s: float = 5.0) -> None:
        """``read``: the hash of a limits key (keys.tenant_limits / keys.api_key) as text."""
        self.read = read
        self.defaults = defaults
        self.cache_s = cache_s
        self._cache: dict[str, tuple[float, dict[str, str]]] = {}
        self._lock = threading.Lock()

    def _fields(self, key: str) -> dict[str, str]:
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and time.monotonic() - hit[0] < self.cache_s:
            return hit[1]
        fields = self.read(key)
        with self._lock:
            self._cache[key] = (time.monotonic(), fields)
        return fields

    def for_submit(self, tenant: str, key_id: str | None = None) -> Quota:
        tenant_fields = self._fields(keys.tenant_limits(tenant))
        key_fields = self._fields(keys.api_key(key_id)) if key_id else {}

        def pick(name: str, default: int) -> int:
            for fields in (key_fields, tenant_fields):
                if fields.get(name, "").strip():
                    return int(fields[name])
            return default

        return Quota(max_active=pick("max_active", self.defaults.max_active),
                     per_minute=pick("per_minute", self.defaults.per_minute))
