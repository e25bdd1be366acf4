"""One attempt of one stage as the job's ledger sees it: the lease taken, held (renewed, and bounded
by the stage's hard time limit), and given back with the attempt's outcome: its outputs committed,
or the job canceled, failed or its next attempt queued.

The attempt is fenced by its lease (omni_jobs.jobs.ledger): a duplicate or stale message is refused
before any work, a result recorded only while the lease holds, and what the result makes runnable
(the next stages, the results step) is dispatched in the same write. Split from the stage runner
(omni_jobs.run.stages) so that these decisions read in one place, apart from the engine call and the
outputs they fence.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TypeVar

from omni_jobs.artifacts import ArtifactRef, ArtifactStoreUnavailable
from omni_jobs.core.errors import JobAlreadyFinished, JobNotFound, StageError, TransientStageError
from omni_jobs.dispatch.leases import LeaseKeeper
from omni_jobs.jobs.ledger import Acquired, JobLedger, Lease, Refused, WrittenOutputs
from omni_jobs.jobs.models import Job, JobError, JobEvent, JobOutput, JobStatus, StageStatus
from omni_jobs.jobs.patience import STORE_DOWN, while_store_down
from omni_jobs.jobs.steps import RunStage, StepOutcome
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.spec import StageSpec
from omni_jobs.run.run_journal import RunJournal
from omni_jobs.run.stage_outputs import EarlyOutputs
from omni_jobs.run.watchdog import hard_time_limit

log = logging.getLogger(__name__)

T = TypeVar("T")

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (ArtifactStoreUnavailable, TransientStageError, *STORE_DOWN)
"""Errors that may pass (a store or the broker unreachable): the next attempt backs off and retries."""


class JobCanceled(Exception):
    """Raised inside an engine callback to stop work for a job that was canceled meanwhile."""


class DeadlineExceeded(JobCanceled):
    """The job's deadline (Cancel-After) passed: it ends canceled, like a user's cancel."""


class LeaseLost(JobCanceled):
    """This attempt's lease was taken back (the worker was cut off): another attempt runs it."""


class StageTimeout(StageError):
    """The stage ran past its soft time limit; it stops at its next step or token."""


ENDINGS: tuple[type[BaseException], ...] = (JobCanceled, StageError, *TRANSIENT_ERRORS)
"""What ends an attempt without its outputs: ``StageAttempt.settle`` records each as its kind asks."""


def job_error(stage_id: str | None, exc: BaseException) -> JobError:
    """The error a failed step records on its job: the stage, the exception type and its message."""
    return JobError(stage=stage_id, type=type(exc).__name__, message=str(exc) or repr(exc))


@dataclass(frozen=True)
class StageLimits:
    """Time limits, the defaults for stages that set none. ``watchdog``: a stage still running at its
    hard time limit fails its job and ends this process (omni_jobs.run.watchdog; worker processes only:
    the supervisor starts a fresh one); else the hard limit is not enforced."""

    soft_time_limit_s: float = 600.0
    time_limit_s: float = 900.0
    watchdog: bool = False

    def for_stage(self, stage: StageSpec) -> tuple[float, float]:
        """(soft, hard) seconds for this stage."""
        return (stage.soft_time_limit_s or self.soft_time_limit_s, stage.time_limit_s or self.time_limit_s)


@dataclass(frozen=True)
class Retries:
    """How an attempt waits out what may pass: ``backoff_s``, the first delay before the next attempt
    after a transient error; ``store_wait_s``, how long a write waits for the job store to come back."""

    backoff_s: float = 1.0
    store_wait_s: float = 600.0

    def delay(self, attempt: int) -> float:
        """Exponential backoff with jitter before the next attempt after a transient error."""
        return float(self.backoff_s * (2 ** (attempt - 1)) * random.uniform(0.5, 1.5))

    def patiently(self, call: Callable[[], T], what: str) -> T:
        """``call``, tried again while the store is down, for ``store_wait_s`` at most."""
        return while_store_down(call, wait_s=self.store_wait_s, what=what)


class StageAttempt:
    """Takes, holds and settles the leases of a process's stage attempts in the job's ledger."""

    def __init__(self, ledger: JobLedger, catalogue: PipelineCatalogue, *, limits: StageLimits, retries: Retries,
                 keeper: LeaseKeeper | None = None, run_journal: RunJournal | None = None) -> None:
        """``keeper``: renews the leases of running attempts (workers; None in one process).
        ``run_journal``: where the engine's start and its recorded result are noted (omni_jobs.run.run_journal)."""
        self.ledger = ledger
        self.catalogue = catalogue
        self.limits = limits
        self.retries = retries
        self.keeper = keeper
        self.run_journal = run_journal

    def take(self, step: RunStage, *, worker: str, owner: str, snapshot: Job | None, where: str) -> Acquired | StepOutcome:
        """The job and the attempt's lease, or why the step is skipped. ``snapshot``: the job as its task
        message was pushed, so the start needs no read first; a refusal decided on it is checked
        against the stored job."""
        patiently = self.retries.patiently
        job = snapshot if snapshot is not None else patiently(lambda: self.ledger.get(step.job_id), where)
        if job is None:
            return StepOutcome("skipped", "job is gone (expired or deleted)")
        taken = patiently(lambda: self.ledger.acquire(step, worker=worker, owner=owner, snapshot=job), where)
        if isinstance(taken, Refused) and snapshot is not None:
            taken = patiently(lambda: self.ledger.acquire(step, worker=worker, owner=owner), where)
        if isinstance(taken, Refused):
            return StepOutcome("skipped", taken.reason)
        return taken

    @contextmanager
    def held(self, job: Job, lease: Lease, step: RunStage, *, on_lost: Callable[[], None]) -> Iterator[None]:
        """The body runs under the attempt's hard time limit, its lease renewed meanwhile (``on_lost``:
        called if it is taken back)."""
        with self._hard_limit(job, lease, step):
            if self.keeper is None:
                yield
            else:
                with self.keeper.hold(lease, on_lost=on_lost):
                    yield

    def _hard_limit(self, job: Job, lease: Lease, step: RunStage) -> AbstractContextManager[None]:
        """The attempt's hard time limit (``limits.watchdog``): past it, the job fails (while this
        attempt's lease holds) and the process ends."""
        if not self.limits.watchdog or job.pipeline not in self.catalogue:
            return nullcontext()
        _soft, hard = self.limits.for_stage(self.catalogue.get(job.pipeline).stage(step.stage_id))
        timeout = StageTimeout(f"stage '{step.stage_id}' ran past its hard time limit of {hard:g}s; its worker was "
                               "restarted (set time_limit_s on the stage or OMNI_STAGE_TIME_LIMIT_S)")

        def on_expire() -> None:
            self.ledger.fail(job.id, job_error(step.stage_id, timeout), lease=lease)

        return hard_time_limit(hard, on_expire)

    def journal(self, lease: Lease, what: str) -> None:
        """Note a point of the attempt in the run journal, if this process keeps one."""
        if self.run_journal is not None:
            self.run_journal.record(lease, what)

    def settle(self, exc: BaseException, job: Job, lease: Lease, step: RunStage, where: str) -> StepOutcome:
        """An attempt ended by ``exc`` (one of ``ENDINGS``): stopped (canceled, its deadline passed, its
        lease lost), the job failed (a stage error), or its next attempt queued after a backoff (an error
        that may pass)."""
        if isinstance(exc, JobCanceled):
            why = "lost" if isinstance(exc, LeaseLost) else "canceled"
            if isinstance(exc, DeadlineExceeded):
                self.retries.patiently(lambda: self.cancel_for_deadline(job.id), where)
            log.info("%s stopped: %s", where, "its lease was lost" if why == "lost" else "the job was canceled")
            return StepOutcome(why, str(exc))
        if isinstance(exc, StageError):
            error = job_error(step.stage_id, exc)
            self.retries.patiently(lambda: self.ledger.fail(job.id, error, lease=lease), where)
            log.error("%s failed: %s", where, exc)
            return StepOutcome("failed", str(exc))
        delay, error = self.retries.delay(step.attempt), job_error(step.stage_id, exc)
        outcome = self.retries.patiently(lambda: self.ledger.retry_later(lease, error, delay), where)
        log.warning("%s: transient error (%s: %s); %s", where, type(exc).__name__, exc,
                    f"attempt {step.attempt + 1} in {delay:.1f}s" if outcome == "retrying" else outcome)
        return StepOutcome("retrying" if outcome == "retrying" else outcome, str(exc))

    def commit(self, job: Job, lease: Lease, step: RunStage, refs: dict[str, ArtifactRef], metrics: dict[str, float],
               *, files: list[JobOutput] | None, writes: list[Future[JobOutput]], tail: list[JobEvent],
               results_worker: str | None, where: str) -> tuple[StepOutcome, Job | None, EarlyOutputs | None]:
        """Record the stage's outputs, while the lease holds, with the stage's last events (``tail``).
        ``results_worker``: results inline, this worker takes the job's results step in the same write
        if the stage completes the job; ``files``, the job's final files it wrote already, end the job
        there if they were made of the outputs the job has. Returns the outcome; the job when this
        attempt took its results step, and the files it began for it (``writes``) when they are still
        to be finished."""
        made_from = [dict(refs) if r.id == step.stage_id else dict(r.outputs) for r in job.stages]
        written = WrittenOutputs(made_from, files) if files is not None else None
        done = self.retries.patiently(lambda: self.ledger.complete_stage(
            lease, refs, metrics, snapshot=job, results_worker=results_worker, first=tail, written=written), where)
        if isinstance(done, Refused):
            log.warning("%s: result discarded: %s", where, done.reason)
            return StepOutcome("discarded", done.reason), None, None
        self.journal(lease, "engine.recorded")
        if written is not None and done.status is JobStatus.succeeded and done.outputs == written.outputs:
            log.info("%s: job succeeded with outputs %s (results inline)", where, [o.name for o in done.outputs])
            return StepOutcome("succeeded", ""), None, None
        took_results = (results_worker is not None and done.results.status is StageStatus.running
                        and done.results.lease_owner == lease.owner)
        if not took_results or not writes:
            return StepOutcome("succeeded", ""), done if took_results else None, None
        return StepOutcome("succeeded", ""), done, EarlyOutputs(made_from, list(writes))

    def cancel_for_deadline(self, job_id: str) -> None:
        """Cancel a job whose deadline (Cancel-After) passed; nothing if it ended meanwhile."""
        try:
            self.ledger.cancel(job_id, reason="deadline exceeded (cancel_after)")
            log.info("job %s passed its deadline; canceled", job_id)
        except (JobAlreadyFinished, JobNotFound):
            pass
