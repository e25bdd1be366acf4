"""The job and stage state machines: pure functions that change a Job and say what happened.

Every status change goes through here, so an illegal one (a finished job started again) is an
error in one place, and every change yields the events that SSE, webhooks and the timeline show.
What a change *causes* (the next step's dispatch, webhook messages, index entries) is derived
from the before/after difference by the ledger, in the same atomic write.
"""

from __future__ import annotations

from omni_jobs.artifacts.refs import ArtifactRef
from omni_jobs.core.errors import InvalidTransition
from omni_jobs.core.json_types import JsonValue
from omni_jobs.jobs.models import (
    EventType,
    Job,
    JobError,
    JobEvent,
    JobStatus,
    Progress,
    StageRecord,
    StageStatus,
    StepSlot,
)

JOB_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.queued: frozenset({JobStatus.running, JobStatus.failed, JobStatus.canceled}),
    JobStatus.running: frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.canceled}),
    JobStatus.succeeded: frozenset(),
    JobStatus.failed: frozenset(),
    JobStatus.canceled: frozenset(),
}

STAGE_TRANSITIONS: dict[StageStatus, frozenset[StageStatus]] = {
    StageStatus.pending: frozenset({StageStatus.queued, StageStatus.canceled}),
    StageStatus.queued: frozenset({StageStatus.running, StageStatus.failed, StageStatus.canceled}),
    # running -> queued: the attempt ended without a result (transient error, lost worker); the next one waits.
    StageStatus.running: frozenset(
        {StageStatus.succeeded, StageStatus.failed, StageStatus.canceled, StageStatus.queued}
    ),
    StageStatus.succeeded: frozenset(),
    StageStatus.failed: frozenset(),
    StageStatus.canceled: frozenset(),
}
OPEN = (StageStatus.pending, StageStatus.queued, StageStatus.running)


def _event(job: Job, type_: EventType, at: float, **data: JsonValue) -> JobEvent:
    return JobEvent(job_id=job.id, type=type_, at=at, data=data)


def _set_job_status(job: Job, new: JobStatus) -> None:
    if new not in JOB_TRANSITIONS[job.status]:
        raise InvalidTransition(f"job {job.id}: {job.status.value} -> {new.value} is not allowed")
    job.status = new


def _set_status(job: Job, what: str, slot: StageRecord | StepSlot, new: StageStatus) -> None:
    if new not in STAGE_TRANSITIONS[slot.status]:
        raise InvalidTransition(f"job {job.id} {what}: {slot.status.value} -> {new.value} is not allowed")
    slot.status = new


def _release(slot: StageRecord | StepSlot) -> None:
    slot.lease_owner = None
    slot.lease_until = None


# --- stages ---
def stage_queued(job: Job, stage_id: str, at: float) -> list[JobEvent]:
    record = job.stage_record(stage_id)
    _set_status(job, f"stage {stage_id}", record, StageStatus.queued)
    record.queued_at = at
    return [_event(job, EventType.stage_queued, at, stage=stage_id)]


def stage_started(job: Job, stage_id: str, worker: str, at: float) -> list[JobEvent]:
    """A worker took the stage's next attempt; the job becomes running if it was queued."""
    events: list[JobEvent] = []
    if job.status is JobStatus.queued:
        _set_job_status(job, JobStatus.running)
        job.started_at = at
        events.append(_event(job, EventType.job_running, at))
    record = job.stage_record(stage_id)
    _set_status(job, f"stage {stage_id}", record, StageStatus.running)
    record.started_at = at
    record.finished_at = None
    record.worker = worker
    record.attempts += 1
    job.stage = stage_id
    job.progress = None
    events.append(_event(job, EventType.stage_started, at, stage=stage_id, worker=worker, attempt=record.attempts))
    return events


def stage_progress(job: Job, stage_id: str, step: int, total: int, unit: str, at: float) -> list[JobEvent]:
    job.progress = Progress(stage=stage_id, step=step, total=total, unit=unit)
    return [_event(job, EventType.stage_progress, at, stage=stage_id, step=step, total=total, unit=unit)]


def stage_succeeded(
    job: Job, stage_id: str, outputs: dict[str, ArtifactRef], metrics: dict[str, float], at: float
) -> list[JobEvent]:
    record = job.stage_record(stage_id)
    _set_status(job, f"stage {stage_id}", record, StageStatus.succeeded)
    record.finished_at = at
    record.outputs = dict(outputs)
    record.metrics = dict(metrics)
    _release(record)
    if job.stage == stage_id:
        job.stage = None
        job.progress = None
    return [_event(job, EventType.stage_succeeded, at, stage=stage_id, duration_s=record.duration_s)]


def stage_requeued(job: Job, stage_id: str, at: float, *, reason: str, retry_at: float,
                   lost: bool) -> list[JobEvent]:
    """The running attempt ended without a result; the next attempt becomes runnable at ``retry_at``.

    ``lost``: its worker stopped renewing the lease (stage.requeued); else it hit a transient error
    and backs off (stage.retrying).
    """
    record = job.stage_record(stage_id)
    attempt = record.attempts
    _set_status(job, f"stage {stage_id}", record, StageStatus.queued)
    record.queued_at = retry_at
    _release(record)
    if job.stage == stage_id:
        job.stage = None
        job.progress = None
    kind = EventType.stage_requeued if lost else EventType.stage_retrying
    return [_event(job, kind, at, stage=stage_id, attempt=attempt, reason=reason,
                   retry_in_s=round(max(0.0, retry_at - at), 3))]


# --- the results step ---
def results_queued(job: Job, at: float) -> None:
    _set_status(job, "results", job.results, StageStatus.queued)
    job.results.queued_at = at


def results_started(job: Job, worker: str) -> None:
    _set_status(job, "results", job.results, StageStatus.running)
    job.results.worker = worker
    job.results.attempts += 1


def results_requeued(job: Job, retry_at: float) -> None:
    _set_status(job, "results", job.results, StageStatus.queued)
    job.results.queued_at = retry_at
    _release(job.results)


# --- the job ends ---
def _close_open_slots(job: Job, at: float, failed_stage: str | None = None) -> None:
    for record in job.stages:
        if record.id == failed_stage and record.status is not StageStatus.succeeded:
            record.status = StageStatus.failed
            record.finished_at = at
        elif record.status in OPEN:
            record.status = StageStatus.canceled
            record.finished_at = at if record.started_at is not None else None
        _release(record)
    if job.results.status in (StageStatus.queued, StageStatus.running):
        job.results.status = StageStatus.canceled
    _release(job.results)
    job.stage = None
    job.progress = None


def job_succeeded(job: Job, at: float) -> list[JobEvent]:
    _set_job_status(job, JobStatus.succeeded)
    job.completed_at = at
    job.results.status = StageStatus.succeeded  # the results step is what ends a job succeeded
    _release(job.results)
    job.stage = None
    job.progress = None
    return [_event(job, EventType.job_succeeded, at)]


def job_failed(job: Job, error: JobError, at: float) -> list[JobEvent]:
    """The job ends failed; its running or waiting stages end with it."""
    _set_job_status(job, JobStatus.failed)
    job.error = error
    job.completed_at = at
    _close_open_slots(job, at, failed_stage=error.stage)
    return [_event(job, EventType.job_failed, at, error=error.model_dump())]


def job_canceled(job: Job, at: float, reason: str = "canceled by request") -> list[JobEvent]:
    _set_job_status(job, JobStatus.canceled)
    job.completed_at = at
    _close_open_slots(job, at)
    return [_event(job, EventType.job_canceled, at, reason=reason)]
