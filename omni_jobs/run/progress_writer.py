"""Stage progress written off the engine's thread, and the stop signals noticed there.

A batched engine reports progress for every member at every step or token, from the one thread
that drives the engine. Writing each report there would keep the engine idle while Redis answers:
on a batch of 64 that was most of a step. The ``ProgressWriter`` keeps only the latest report per
running stage and writes it from a background thread. The write is fenced by the stage's lease, so
it is also where a stage learns that it must stop: its job was canceled, or its lease was lost
(``stopped``); the lease keeper reports lost leases here too. The stage's reporter raises at its
next step. In-process use (``background=False``) writes inline, in order.

DiT previews (``output.preview`` events) go the same way: the engine's thread hands over a cheap
maker (a CPU copy of the latents); this thread projects, encodes and publishes it, newest per
stage wins. A refused publish (canceled, lease lost) stops the stage like a refused progress write.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from omni_jobs.core.json_types import JsonObject
from omni_jobs.jobs.ledger import JobLedger, Lease
from omni_jobs.jobs.models import EventType, Job

log = logging.getLogger(__name__)

Report = tuple[Lease, Job, int, int, str]
"""(lease, job snapshot, step, total, unit) of one running stage."""
Preview = tuple[Lease, Job, Callable[[], JsonObject]]
"""(lease, job snapshot, what makes the output.preview event's data) of one running stage."""


class ProgressWriter:
    """Writes the newest progress of each running stage; remembers which stages must stop, and why."""

    def __init__(self, ledger: JobLedger, *, background: bool = True) -> None:
        self.ledger = ledger
        self.background = background
        self._pending: dict[Lease, Report] = {}
        self._previews: dict[Lease, Preview] = {}
        self._active: set[Lease] = set()
        self._stopped: dict[Lease, str] = {}
        self._writing = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def begin(self, lease: Lease) -> None:
        """An attempt starts: from now on, what stops it is remembered (by its own lease: a late
        write or renewal of an earlier attempt of the same stage never stops this one)."""
        with self._cond:
            self._active.add(lease)

    def report(self, lease: Lease, job: Job, step: int, total: int, unit: str) -> None:
        """Record progress; returns at once in background mode (an older unwritten report is replaced)."""
        if not self.background:
            self._write((lease, job, step, total, unit))
            return
        with self._cond:
            self._pending[lease] = (lease, job, step, total, unit)
            self._wake()

    def preview(self, lease: Lease, job: Job, make: Callable[[], JsonObject]) -> None:
        """Publish a preview event whose data ``make`` returns (called off the engine's thread in
        background mode; an older unpublished preview of the same stage is replaced)."""
        if not self.background:
            self._write_preview((lease, job, make))
            return
        with self._cond:
            self._previews[lease] = (lease, job, make)
            self._wake()

    def drain(self, lease: Lease, timeout_s: float = 5.0) -> bool:
        """Wait until this stage's last preview is published (before its result is recorded, which
        ends the lease the publish needs); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: lease not in self._previews and not self._writing, timeout_s)

    def _wake(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="omni-progress-writer", daemon=True)
            self._thread.start()
        self._cond.notify()

    def stopped(self, lease: Lease) -> str | None:
        """'canceled' or 'lost' once the attempt must stop; None while it may go on."""
        with self._cond:
            return self._stopped.get(lease)

    def stop(self, lease: Lease, why: str) -> None:
        """Tell a running attempt to stop (ignored once it ended)."""
        with self._cond:
            if lease in self._active:
                self._stopped[lease] = why

    def finish(self, lease: Lease) -> None:
        """The attempt ended: drop its unwritten report and its stop mark."""
        with self._cond:
            self._pending.pop(lease, None)
            self._previews.pop(lease, None)
            self._stopped.pop(lease, None)
            self._active.discard(lease)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every report made so far is written (tests, shutdown); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._previews and not self._writing,
                                       timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending or self._previews))
                batch, self._pending = self._pending, {}
                previews, self._previews = self._previews, {}
                self._writing = True
            try:
                self._write_all(list(batch.values()))
                for preview in previews.values():
                    self._write_preview(preview)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, report: Report) -> None:
        lease, job, step, total, unit = report
        self._settle(lease, "write progress", lambda: self.ledger.progress(lease, job, step, total, unit))

    def _write_all(self, reports: list[Report]) -> None:
        """Every running stage's newest report in one round trip (a batch reports for all its members)."""
        if not reports:
            return
        try:
            outcomes = self.ledger.progress_many(reports)
        except Exception:  # logged and dropped: the next reports carry on
            log.warning("could not write the progress of %d stages", len(reports), exc_info=True)
            return
        for (lease, *_rest), outcome in zip(reports, outcomes, strict=True):
            if outcome != "ok":
                self.stop(lease, outcome)

    def _settle(self, lease: Lease, what: str, write: Callable[[], str]) -> None:
        """Run one lease-guarded write; a refusal ('canceled', 'lost') stops the stage. In the background
        a failed write is logged and dropped (the next report carries on); inline it raises."""
        try:
            outcome = write()
        except Exception:
            if not self.background:
                raise
            log.warning("job %s: could not %s of %s", lease.job_id, what, lease.slot, exc_info=True)
            return
        if outcome != "ok":
            self.stop(lease, outcome)

    def _write_preview(self, preview: Preview) -> None:
        lease, job, make = preview
        with self._cond:
            if lease in self._stopped:
                return
        try:
            data = make()
        except Exception:  # a preview that cannot be made is skipped; it never fails the stage
            log.warning("job %s: could not make a preview of %s", lease.job_id, lease.slot, exc_info=True)
            return
        self._settle(lease, "publish a preview", lambda: self.ledger.publish(lease, job, EventType.output_preview, data))
