"""Leases: how a running step proves its worker is alive, and how a dead worker's steps come back.

A worker that starts a step holds a lease on its slot (owner, attempt, expiry). ``LeaseKeeper``
renews every lease of its process from its own thread, which never waits on an engine, so a busy
GPU never lets a lease lapse; a lease it finds lost (the job was canceled, or the lease was taken
back after a network cut) is reported so the step stops. ``Reaper`` runs in every worker and in
cleanup, one pass at a time under a lock. It:

- queues the next attempt of every slot whose lease expired (its worker was killed, OOM, lost), but
  not while the store is fresh from an outage: leases lapse while Redis is away whether their workers
  live or not, so for ``grace_s`` after the reaper reaches the store again (or after Redis started,
  ``store_uptime_s``) it waits for the live workers' keepers, which retry every second, to renew them;
- at a worker's start, takes back at once what the previous process of the same node held;
- cancels the jobs past their Cancel-After deadline that no worker runs (waiting on a queue with
  no workers, say): within a pass, whichever workers run;
- publishes again a published step whose message vanished: not started ``dispatch_timeout_s``
  after it was due while its queue in the broker is empty (lost by the broker, or prefetched by a
  worker that died before starting it). A duplicate is harmless: the ledger starts each attempt once.

So recovery takes seconds (``lease_s`` plus a reaper pass), not the broker's visibility timeout.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from omni_jobs.core import keys
from omni_jobs.dispatch.cancellation import cancel_overdue
from omni_jobs.jobs.ledger import JobLedger, Lease
from omni_jobs.jobs.models import now
from omni_jobs.jobs.store import JobStore

log = logging.getLogger(__name__)

RETRY_S = 1.0
"""How soon a lease keeper whose renewal failed tries again."""


def lease_owner(worker: str) -> str:
    """This process's lease owner token: ``<node>#<pid>.<nonce>``, unique even when a restarted
    worker reuses its node name (which is how its predecessor's leases are recognised). Each step
    execution adds ``/<token>`` to it (omni_jobs.executor)."""
    return f"{worker}#{os.getpid()}.{secrets.token_hex(4)}"


def node_of(owner: str | None) -> str | None:
    """The worker node of a lease owner: ``dit@host`` of ``dit@host#12.ab/cd``."""
    return owner.split("/", 1)[0].rsplit("#", 1)[0] if owner and "#" in owner else None


def process_of(owner: str | None) -> str | None:
    """The process part of a lease owner: ``dit@host#12.ab`` of ``dit@host#12.ab/cd``."""
    return owner.split("/", 1)[0] if owner else None


class LeaseKeeper:
    """Renews the leases this process holds, every ``every_s``, from a daemon thread."""

    def __init__(self, ledger: JobLedger, *, every_s: float) -> None:
        self.ledger = ledger
        self.every_s = every_s
        self._held: dict[str, tuple[Lease, Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0

    @contextmanager
    def hold(self, lease: Lease, on_lost: Callable[[], None]) -> Iterator[None]:
        """Keep ``lease`` renewed while the body runs; ``on_lost`` is called if it is lost meanwhile."""
        self._ensure_thread()
        with self._lock:
            self._held[lease.slot] = (lease, on_lost)
        try:
            yield
        finally:
            with self._lock:
                self._held.pop(lease.slot, None)

    def held(self) -> list[Lease]:
        with self._lock:
            return [lease for lease, _ in self._held.values()]

    def renew_now(self) -> list[Lease]:
        """One renewal pass; returns the leases found lost (their holders were told)."""
        with self._lock:
            held = dict(self._held)
        if not held:
            return []
        lost = self.ledger.renew([lease for lease, _ in held.values()])
        for lease in lost:
            log.warning("job %s: lost the lease of %s attempt %d (job ended, or the lease was taken back); "
                        "stopping it", lease.job_id, lease.slot, lease.attempt)
            held[lease.slot][1]()
        return lost

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive() and self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._loop, name="omni-lease-keeper", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        wait_s = self.every_s
        while True:
            time.sleep(wait_s)
            try:
                self.renew_now()
                wait_s = self.every_s
            except Exception as exc:  # noqa: BLE001 - Redis away: the leases keep until they expire; try again
                # soon: the reaper gives live workers a grace once the store is back (Reaper.grace_s)
                wait_s = min(self.every_s, RETRY_S)
                log.warning("cannot renew leases (%s: %s); retrying in %.1fs", type(exc).__name__, exc, wait_s)


@dataclass
class ReapReport:
    requeued: int = 0
    failed: int = 0
    cleaned: int = 0
    redispatched: int = 0
    canceled: int = 0
    deferred: int = 0
    """Expired leases left for a later pass: the store is fresh from an outage (``Reaper.grace_s``)."""
    details: list[str] = field(default_factory=list)

    def count(self, outcome: str, slot: str) -> None:
        if outcome in ("requeued", "gave_up"):
            self.requeued += 1
        elif outcome == "failed":
            self.failed += 1
        elif outcome == "cleaned":
            self.cleaned += 1
        else:
            return
        self.details.append(f"{slot}: {outcome}")


class Reaper:
    def __init__(self, ledger: JobLedger, store: JobStore, *, owner: str, queues: Callable[[], Iterable[str]],
                 queue_depth: Callable[[str], int] | None = None, dispatch_timeout_s: float = 20.0,
                 backlog_timeout_s: float = 3600.0, interval_s: float = 2.0, batch: int = 100,
                 grace_s: float = 0.0, store_uptime_s: Callable[[], float] | None = None) -> None:
        """``queue_depth``: messages waiting in the broker for a queue (None: no dispatch watchdog).
        A step sent and not started is sent again after ``dispatch_timeout_s`` once its queue is empty,
        and after ``backlog_timeout_s`` even behind a backlog (the broker keeps no copy of a message a
        worker took: see omni_jobs.dispatch.queueing); a copy that was not lost after all is skipped.

        ``grace_s``: expired leases are left alone for this long after a pass failed on the store and
        one got through again, and while the store (``store_uptime_s``: its server's uptime) is younger:
        every lease lapses during an outage longer than the lease, and live workers need a moment to
        renew theirs (the runtime gives a renewal interval and two reaper passes). A worker that stayed
        cut off past it loses its lease as before, and stops its step when it learns so."""
        self.ledger = ledger
        self.store = store
        self.owner = owner
        self.queues = queues
        self.queue_depth = queue_depth
        self.dispatch_timeout_s = dispatch_timeout_s
        self.backlog_timeout_s = backlog_timeout_s
        self.interval_s = interval_s
        self.batch = batch
        self.grace_s = grace_s
        self.store_uptime_s = store_uptime_s
        self._store_failed = False
        self._store_back_at = float("-inf")
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def store_failed(self) -> None:
        """A pass could not reach the store: the next that does starts a grace period."""
        self._store_failed = True

    def in_grace(self) -> bool:
        """Whether expired leases wait: the store is back from an outage less than ``grace_s`` ago."""
        if self.grace_s <= 0:
            return False
        if time.monotonic() - self._store_back_at < self.grace_s:
            return True
        return self.store_uptime_s is not None and self.store_uptime_s() < self.grace_s

    def run_once(self) -> ReapReport:
        report = ReapReport()
        # One pass per interval across all processes. The lock saves work, not correctness: every
        # transition below is guarded, so two overlapping passes cannot both take a slot back.
        if not self.store.try_lock(keys.REAPER_LOCK, self.owner, max(0.2, self.interval_s * 0.9)):
            return report
        if self._store_failed:
            self._store_failed, self._store_back_at = False, time.monotonic()
        expired = self.store.expired_leases(now=now(), limit=self.batch)
        if expired and self.in_grace():
            report.deferred = len(expired)
            log.info("reaper: %d expired lease(s) wait %.0fs after the store came back, for live workers to "
                     "renew them", len(expired), self.grace_s)
            expired = []
        for slot in expired:
            report.count(self.ledger.expire(slot), slot)
        for job_id in cancel_overdue(self.ledger, at=now(), limit=self.batch):
            report.canceled += 1
            report.details.append(f"{job_id}: canceled (Cancel-After)")
        if self.queue_depth is not None:
            for queue in sorted(set(self.queues())):
                self._watch_dispatches(queue, report)
        if report.details:
            log.info("reaper: %s", ", ".join(report.details))
        return report

    def _watch_dispatches(self, queue: str, report: ReapReport) -> None:
        assert self.queue_depth is not None
        at = now()
        stale = self.store.released(queue, before=at - self.dispatch_timeout_s, limit=self.batch)
        if not stale:
            return
        why = f"queue '{queue}' was empty for {self.dispatch_timeout_s:g}s while it waited"
        if self.queue_depth(queue) > 0:  # messages still wait in the broker: it may be a backlog
            stale = self.store.released(queue, before=at - self.backlog_timeout_s, limit=self.batch)
            why = f"not started {self.backlog_timeout_s:g}s after it was sent, behind a backlog"
        for slot in stale:
            if self.ledger.redispatch(slot, queue):
                report.redispatched += 1
                report.details.append(f"{slot}: redispatched ({why})")

    def reclaim_node(self, node: str, current_owner: str) -> ReapReport:
        """At a worker's start: what earlier processes of the same node held is lost; take it back now."""
        report = ReapReport()

        def dead(owner: str | None) -> bool:
            return owner is not None and process_of(owner) != current_owner and node_of(owner) == node

        for slot in self.store.leased_slots():
            report.count(self.ledger.expire(slot, dead_owner=dead), slot)
        if report.details:
            log.warning("worker %s restarted: took back %s", node, ", ".join(report.details))
        return report

    def start(self) -> Reaper:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="omni-reaper", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception as exc:  # noqa: BLE001 - Redis away: try again next interval
                self.store_failed()
                log.warning("reaper pass failed (%s: %s); next in %.1fs", type(exc).__name__, exc, self.interval_s)
