"""Stage progress written to the job store off the engine's thread, and cancels noticed there.

A batched engine reports progress for every member at every step or token, from the one thread
that drives the engine. Writing each report there (a WATCH transaction on the job, an event on its
stream) keeps the engine idle while Redis answers: on a batch of 64 that was most of a step. The
``ProgressWriter`` keeps only the latest report per (job, stage) and writes it from a background
thread; the write is also where a cancel is seen, and the stage's reporter raises ``JobCanceled``
at its next step. In-process use (``background=False``) writes inline, in order, as before.
"""

from __future__ import annotations

import logging
import threading

from omni_jobs.errors import JobNotFound
from omni_jobs.jobs import state
from omni_jobs.jobs.models import Job, JobEvent, JobStatus, StageStatus, now
from omni_jobs.jobs.store import JobStore

log = logging.getLogger(__name__)

Report = tuple[int, int, str]
"""(step, total, unit) of one stage of one job."""


class _Canceled(Exception):
    """Raised inside a store mutation: the job was canceled, write nothing."""


class _NotRunning(Exception):
    """Raised inside a store mutation: the stage is no longer running (a late report), write nothing."""


class ProgressWriter:
    """Writes the newest progress of each running stage; remembers which jobs were found canceled."""

    def __init__(self, store: JobStore, *, background: bool = True) -> None:
        self.store = store
        self.background = background
        self._pending: dict[tuple[str, str], Report] = {}
        self._canceled: set[str] = set()
        self._writing = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def report(self, job_id: str, stage_id: str, step: int, total: int, unit: str) -> None:
        """Record progress; returns at once in background mode (an older unwritten report is replaced)."""
        if not self.background:
            self._write(job_id, stage_id, (step, total, unit))
            return
        with self._cond:
            self._pending[(job_id, stage_id)] = (step, total, unit)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="progress-writer", daemon=True)
                self._thread.start()
            self._cond.notify()

    def canceled(self, job_id: str) -> bool:
        """Whether a progress write found this job canceled."""
        with self._cond:
            return job_id in self._canceled

    def finish(self, job_id: str, stage_id: str) -> None:
        """The stage ended: drop its unwritten report (its final state is written by the runner)."""
        with self._cond:
            self._pending.pop((job_id, stage_id), None)
            self._canceled.discard(job_id)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every report made so far is written (tests, shutdown); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._writing, timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending))
                batch, self._pending = self._pending, {}
                self._writing = True
            try:
                for (job_id, stage_id), report in batch.items():
                    self._write(job_id, stage_id, report)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, job_id: str, stage_id: str, report: Report) -> None:
        step, total, unit = report

        def mutate(job: Job) -> list[JobEvent]:
            if job.status is JobStatus.canceled:
                raise _Canceled()
            if job.status.is_final or job.stage_record(stage_id).status is not StageStatus.running:
                raise _NotRunning()
            return state.stage_progress(job, stage_id, step, total, unit, now())

        try:
            self.store.update(job_id, mutate)
        except _Canceled:
            with self._cond:
                self._canceled.add(job_id)
        except (_NotRunning, JobNotFound):
            pass
        except Exception:
            if not self.background:
                raise
            log.warning("job %s stage %s: could not write progress", job_id, stage_id, exc_info=True)
