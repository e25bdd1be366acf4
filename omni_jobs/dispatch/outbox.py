"""The outbox relay: publishes the steps that committed transitions wrote to the outbox.

A transition never publishes: it writes its dispatches into the outbox in the same atomic write
as the state change (omni_jobs.jobs.ledger). A relay in each process that writes (the API, every
worker) wakes up at once after its own commits (one that only made steps ready, when the
scheduler's pass could release one), and every ``poll_s`` anyway while its passes find work (each
empty pass doubles the wait, up to ``idle_poll_s``, never past the time the outbox's next entry comes
due), runs the scheduler's pass and claims the due
entries (each claim holds an entry for ``hold_s``, so two relays do not publish it together),
publishes them through the transport, and removes them. A relay that dies after claiming leaves
its entries to the others once the hold runs out; one that dies after publishing but before
removing makes the next relay publish a duplicate, which the ledger refuses by attempt. So every
dispatch is published at least once, whatever crashes, and runs at most once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from omni_jobs.dispatch.scheduling import Scheduler
from omni_jobs.jobs.change import Change, OutboxEntry
from omni_jobs.jobs.models import now
from omni_jobs.jobs.steps import Step
from omni_jobs.jobs.store import JobStore

log = logging.getLogger(__name__)

Publish = Callable[[list[Step], list[str]], None]
"""(steps, their outbox ids) -> None once the transport accepted them all; raises if it did not."""


class OutboxRelay:
    def __init__(self, store: JobStore, publish: Publish, *, hold_s: float = 5.0, poll_s: float = 0.5,
                 idle_poll_s: float | None = None, batch: int = 200, scheduler: Scheduler | None = None) -> None:
        """``scheduler``: its pass (omni_jobs.dispatch.scheduling) runs first, in the same script as the
        claim: it moves the stages whose turn came from their queue's ready lists into the outbox. A
        commit that only made steps ready wakes the relay where it could release one
        (Scheduler.may_release).

        ``idle_poll_s``: the longest wait between passes that find nothing (None: ``poll_s``, no
        backing off). The pass says when the outbox's next entry comes due (a retry's backoff, an
        entry another relay claimed and did not publish), and the relay wakes for it. What a live
        process writes, its own relay publishes at once (woken by the commit), so backing off delays
        only an entry whose writer died before its relay published it: another relay's next pass,
        up to ``idle_poll_s`` later instead of ``poll_s``."""
        self.store = store
        self.publish = publish
        self.scheduler = scheduler
        self.hold_s = hold_s
        self.poll_s = poll_s
        self.idle_poll_s = max(poll_s, idle_poll_s) if idle_poll_s is not None else poll_s
        self._next_due: float | None = None  # from the last pass; None: unknown or nothing due
        self.batch = batch
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._guard = threading.Lock()
        self._failing_since: float | None = None
        self._stopped = False  # stop() was called: a commit's wake no longer starts it (start() does)

    def run_once(self) -> int:
        """Publish what is due now; returns how many entries went out."""
        entries: list[OutboxEntry]
        published = 0  # entries the script pushed onto the broker itself (a store that is the broker)
        self._next_due = None
        if self.scheduler is not None:
            done, entries = self.store.release_and_claim(self.scheduler.windows(), now=now(), limit=self.batch,
                                                         hold_s=self.hold_s)
            self.scheduler.passed(done)
            published = done.published
            self._next_due = done.next_due if done.next_due is not None else float("inf")
        else:
            entries = self.store.claim_outbox(now=now(), limit=self.batch, hold_s=self.hold_s)
        if not entries:
            return published
        ids = [e.id for e in entries]
        self.publish([e.step for e in entries], ids)
        self.store.ack_outbox(ids)
        return published + len(entries)

    def wake(self, change: Change | None = None) -> None:
        """A commit of this process (``change``) wrote outbox entries, made steps ready or freed a
        place in a queue's window: publish now (starts the relay if needed). Called after every such
        commit (each submit): a commit that only made steps ready where no pass could release them
        (Scheduler.may_release: no live worker, or a full window) does not wake it, which under a
        burst of submits was about a fifth of the API's CPU per submit (bench.submit). A commit that
        frees a place always does: the step waiting for it goes out now, not at the next poll. A relay
        that was stopped stays stopped: a commit through a closed API app must not bring its relay back."""
        thread = self._thread
        if change is not None and change.passed is not None:
            # The commit ran the pass for its queues and pushed its due steps onto the broker itself.
            if self.scheduler is not None:
                self.scheduler.passed_in_commit(change)
            if thread is not None and thread.is_alive() and self._pid == os.getpid():
                return
        if self._stopped:
            return
        if thread is None or self._pid != os.getpid() or not thread.is_alive():
            self.start()
        elif (change is not None and not change.outbox and not change.freed and self.scheduler is not None
                and not self.scheduler.may_release({step.queue for step in change.scheduled})):
            return
        if not self._wake.is_set():
            self._wake.set()

    def start(self) -> OutboxRelay:
        """Run in a daemon thread of this process (again after a fork: threads do not survive one)."""
        with self._guard:
            if self._thread is not None and self._thread.is_alive() and self._pid == os.getpid():
                return self
            self._pid = os.getpid()
            self._stopped = False
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="omni-outbox-relay", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped = True
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(timeout_s)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Publish until nothing is due (tests, shutdown); False if it did not get there in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.run_once() == 0:
                return True
        return False

    def next_wait(self, last_s: float, *, busy: bool) -> float:
        """How long to wait before the next pass: ``poll_s`` after one that published (or was woken),
        else twice the last wait, up to ``idle_poll_s``; never past the next entry's due time."""
        if busy or self._next_due is None:
            return self.poll_s
        wait = min(max(2 * last_s, self.poll_s), self.idle_poll_s)
        return max(min(wait, self._next_due - now()), 0.05)  # an entry due now: soon, not in a busy loop

    def _loop(self) -> None:
        wait_s = self.poll_s
        while not self._stop.is_set():
            woken = self._wake.is_set()
            self._wake.clear()
            try:
                sent = self.run_once()
                if self._failing_since is not None:
                    log.info("outbox relay: publishing again after %.1fs", time.monotonic() - self._failing_since)
                    self._failing_since = None
            except Exception as exc:  # noqa: BLE001 - Redis or the broker is away: the entries stay, retried later
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                    log.warning("outbox relay: cannot publish (%s: %s); retrying every %.1fs",
                                type(exc).__name__, exc, self.poll_s)
                sent = 0
                self._next_due = None  # retry at the base pace
            if sent >= self.batch:
                continue
            wait_s = self.next_wait(wait_s, busy=sent > 0 or woken)
            self._wake.wait(wait_s)
