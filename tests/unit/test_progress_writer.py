"""Stage progress written off the engine's thread: coalesced, fenced by the attempt's lease (never
after the attempt ended), and the place where a cancel or a lost lease is noticed. In-memory job
store and the real ledger, no services."""

from __future__ import annotations

import threading

from omni_jobs.accept.submission import build_job, resolve_params
from omni_jobs.dispatch.cancellation import cancel_job
from omni_jobs.jobs.change import Change, Conflict
from omni_jobs.jobs.ledger import Acquired, JobLedger, Lease
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.models import EventType, Job, JobError, StageStatus
from omni_jobs.jobs.steps import RunStage
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.run.progress_writer import ProgressWriter

T2I = load_catalogue().get("text-to-image")
WRITER_THREAD = "omni-progress-writer"


class SlowStore(MemoryJobStore):
    """Holds the progress writer's commits until released, as a slow Redis would: reports pile up
    meanwhile. Other commits (the runner's own transitions, a cancel) go through."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()

    def commit(self, change: Change) -> Conflict | None:
        if threading.current_thread().name == WRITER_THREAD:
            self.held.set()
            self.gate.wait(10)
        return super().commit(change)


def running(ledger: JobLedger, stage: str = "ar") -> tuple[Job, Lease]:
    """A text-to-image job whose first stage runs attempt 1 on worker ``w``: the snapshot and lease a runner holds."""
    job, _ = ledger.submit(build_job(T2I, {"prompt": "a cat"}, resolve_params(T2I, {})), [stage])
    taken = ledger.acquire(RunStage(job.id, stage, 1, stage), worker="w", owner="w#1")
    assert isinstance(taken, Acquired), taken
    return taken.job, taken.lease


def progress_steps(ledger: JobLedger, job_id: str) -> list[int]:
    return [e.data["step"] for e in ledger.events(job_id) if e.type is EventType.stage_progress]


def test_report_returns_before_the_write_and_only_the_newest_report_is_written() -> None:
    ledger = JobLedger(SlowStore())
    store = ledger.store
    assert isinstance(store, SlowStore)
    job, lease = running(ledger)
    writer = ProgressWriter(ledger)
    writer.begin(lease)  # what StageRunner.run does when the attempt starts
    store.gate.clear()  # the store stalls: report() must not
    writer.report(lease, job, 1, 32, "tokens")
    assert store.held.wait(5)  # the first report is taken, its write held
    for step in range(2, 11):
        writer.report(lease, job, step, 32, "tokens")
    assert progress_steps(ledger, job.id) == []
    store.gate.set()
    assert writer.flush()
    assert progress_steps(ledger, job.id) == [1, 10]  # the one already taken, then only the newest
    progress = ledger.require(job.id).progress
    assert progress is not None and (progress.stage, progress.step, progress.total, progress.unit) == (
        "ar", 10, 32, "tokens")
    assert writer.stopped(lease) is None


def test_a_write_finds_the_cancel_and_the_stage_sees_it() -> None:
    ledger = JobLedger(MemoryJobStore())
    job, lease = running(ledger)
    writer = ProgressWriter(ledger)
    writer.begin(lease)  # what StageRunner.run does when the attempt starts
    cancel_job(ledger, job.id)
    assert writer.stopped(lease) is None  # nothing has told the writer yet
    writer.report(lease, job, 3, 32, "tokens")  # the runner's snapshot still says running
    assert writer.flush()
    assert writer.stopped(lease) == "canceled"
    assert progress_steps(ledger, job.id) == [] and ledger.require(job.id).progress is None  # nothing written
    writer.finish(lease)
    assert writer.stopped(lease) is None


def test_a_write_finds_a_lost_lease_and_writes_nothing() -> None:
    """The reaper took the attempt back (its worker was cut off): the job goes on, this attempt stops."""
    ledger = JobLedger(MemoryJobStore())
    job, lease = running(ledger)
    assert ledger.expire(lease.slot, dead_owner=lambda owner: owner == "w#1") == "requeued"
    writer = ProgressWriter(ledger)
    writer.begin(lease)  # what StageRunner.run does when the attempt starts
    writer.report(lease, job, 3, 32, "tokens")
    assert writer.flush()
    assert writer.stopped(lease) == "lost"
    after = ledger.require(job.id)
    assert after.progress is None and after.stage_record("ar").status is StageStatus.queued
    assert progress_steps(ledger, job.id) == []


def test_a_late_report_never_lands_after_the_stage_ended() -> None:
    ledger = JobLedger(SlowStore())
    store = ledger.store
    assert isinstance(store, SlowStore)
    job, lease = running(ledger)
    writer = ProgressWriter(ledger)
    writer.begin(lease)  # what StageRunner.run does when the attempt starts
    store.gate.clear()
    writer.report(lease, job, 31, 32, "tokens")  # taken by the writer, stuck in the store
    assert store.held.wait(5)
    ended = ledger.complete_stage(lease, {}, {})  # the stage ends meanwhile
    assert isinstance(ended, Job)
    writer.report(lease, job, 32, 32, "tokens")
    writer.finish(lease)  # drops the unwritten 32
    store.gate.set()
    assert writer.flush()
    after = ledger.require(job.id)
    assert after.progress is None and after.stage is None
    assert after.stage_record("ar").status is StageStatus.succeeded
    assert progress_steps(ledger, job.id) == []  # the held write was fenced out by the attempt's end


def test_a_stop_found_by_a_late_write_does_not_stop_the_next_attempt() -> None:
    """Attempt 1 hits a transient error while its progress write is in flight; that write then finds
    the slot requeued. Attempt 2 of the same stage, in the same worker, must still run."""
    ledger = JobLedger(SlowStore())
    store = ledger.store
    assert isinstance(store, SlowStore)
    job, first = running(ledger)
    writer = ProgressWriter(ledger)
    writer.begin(first)  # what StageRunner.run does when the attempt starts
    store.gate.clear()
    writer.report(first, job, 3, 32, "tokens")
    assert store.held.wait(5)
    error = JobError(stage="ar", type="ArtifactStoreUnavailable", message="s3 down")
    assert ledger.retry_later(first, error, 0.0) == "retrying"
    writer.finish(first)  # what StageRunner.run does when attempt 1 returns
    store.gate.set()
    assert writer.flush()
    taken = ledger.acquire(RunStage(job.id, "ar", 2, "ar"), worker="w", owner="w#1")
    assert isinstance(taken, Acquired), taken
    assert writer.stopped(taken.lease) is None, "attempt 2 was told to stop by attempt 1's late write"


def test_inline_mode_writes_before_report_returns() -> None:
    ledger = JobLedger(MemoryJobStore())
    job, lease = running(ledger)
    writer = ProgressWriter(ledger, background=False)
    writer.begin(lease)  # what StageRunner.run does when the attempt starts
    writer.report(lease, job, 5, 8, "steps")
    assert progress_steps(ledger, job.id) == [5]
    progress = ledger.require(job.id).progress
    assert progress is not None and progress.step == 5
    cancel_job(ledger, job.id)
    writer.report(lease, job, 6, 8, "steps")
    assert writer.stopped(lease) == "canceled" and progress_steps(ledger, job.id) == [5]
    assert ledger.require(job.id).progress is None  # the cancel cleared it; the refused write did not set it


def test_stop_marks_one_attempt_until_it_finishes() -> None:
    """The lease keeper reports a lost lease here; the stage's reporter reads it at its next step."""
    ledger = JobLedger(MemoryJobStore())
    job, lease = running(ledger)
    other = Lease(RunStage(job.id, "dit", 1, "dit"), "w#1")
    writer = ProgressWriter(ledger)
    writer.begin(lease)  # what StageRunner.run does when the attempt starts
    writer.stop(lease, "lost")
    assert writer.stopped(lease) == "lost" and writer.stopped(other) is None
    writer.finish(lease)
    assert writer.stopped(lease) is None
