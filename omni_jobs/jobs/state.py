"""The job and stage state machines: pure functions that change a Job and say what happened.

Every status change goes through here, so an illegal one (a finished job started again) is an
error in one place, and every change yields the event that SSE, webhooks and the timeline show.
"""

from __future__ import annotations

from typing import Any

from omni_jobs.artifacts.refs import ArtifactRef
from omni_jobs.errors import InvalidTransition
from omni_jobs.jobs.models import Job, JobError, JobEvent, JobStatus, Progress, StageStatus

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
    # running -> queued: the stage is retried or redelivered after a worker was lost.
    StageStatus.running: frozenset(
        {StageStatus.succeeded, StageStatus.failed, StageStatus.canceled, StageStatus.queued, StageStatus.running}
    ),
    StageStatus.succeeded: frozenset(),
    StageStatus.failed: frozenset(),
    StageStatus.canceled: frozenset(),
}


def _event(job: Job, type_: str, at: float, **data: Any) -> JobEvent:
    return JobEvent(job_id=job.id, type=type_, at=at, data=data)


def _set_job_status(job: Job, new: JobStatus) -> None:
    if new not in JOB_TRANSITIONS[job.status]:
        raise InvalidTransition(f"job {job.id}: {job.status.value} -> {new.value} is not allowed")
    job.status = new


def _set_stage_status(job: Job, stage_id: str, new: StageStatus) -> None:
    record = job.stage_record(stage_id)
    if new not in STAGE_TRANSITIONS[record.status]:
        raise InvalidTransition(f"job {job.id} stage {stage_id}: {record.status.value} -> {new.value} is not allowed")
    record.status = new


def stage_queued(job: Job, stage_id: str, at: float) -> list[JobEvent]:
    _set_stage_status(job, stage_id, StageStatus.queued)
    job.stage_record(stage_id).queued_at = at
    return [_event(job, "stage.queued", at, stage=stage_id)]


def stage_started(job: Job, stage_id: str, worker: str, at: float) -> list[JobEvent]:
    """A worker took the stage; the job becomes running if it was queued."""
    events: list[JobEvent] = []
    if job.status is JobStatus.queued:
        _set_job_status(job, JobStatus.running)
        job.started_at = at
        events.append(_event(job, "job.running", at))
    record = job.stage_record(stage_id)
    _set_stage_status(job, stage_id, StageStatus.running)
    record.started_at = at
    record.finished_at = None
    record.worker = worker
    record.attempts += 1
    job.stage = stage_id
    job.progress = None
    events.append(_event(job, "stage.started", at, stage=stage_id, worker=worker, attempt=record.attempts))
    return events


def stage_progress(job: Job, stage_id: str, step: int, total: int, unit: str, at: float) -> list[JobEvent]:
    job.progress = Progress(stage=stage_id, step=step, total=total, unit=unit)
    return [_event(job, "stage.progress", at, stage=stage_id, step=step, total=total, unit=unit)]


def stage_succeeded(
    job: Job, stage_id: str, outputs: dict[str, ArtifactRef], metrics: dict[str, float], at: float
) -> list[JobEvent]:
    record = job.stage_record(stage_id)
    _set_stage_status(job, stage_id, StageStatus.succeeded)
    record.finished_at = at
    record.outputs = dict(outputs)
    record.metrics = dict(metrics)
    if job.stage == stage_id:
        job.stage = None
        job.progress = None
    return [_event(job, "stage.succeeded", at, stage=stage_id, duration_s=record.duration_s)]


def job_succeeded(job: Job, at: float) -> list[JobEvent]:
    _set_job_status(job, JobStatus.succeeded)
    job.completed_at = at
    job.stage = None
    job.progress = None
    return [_event(job, "job.succeeded", at)]


def job_failed(job: Job, error: JobError, at: float) -> list[JobEvent]:
    """The job ends failed; its running or waiting stages end with it."""
    _set_job_status(job, JobStatus.failed)
    job.error = error
    job.completed_at = at
    for record in job.stages:
        if record.id == error.stage and record.status is not StageStatus.succeeded:
            record.status = StageStatus.failed
            record.finished_at = at
        elif record.status in (StageStatus.pending, StageStatus.queued, StageStatus.running):
            record.status = StageStatus.canceled
    job.stage = None
    job.progress = None
    return [_event(job, "job.failed", at, error=error.model_dump())]


def job_canceled(job: Job, at: float, reason: str = "canceled by request") -> list[JobEvent]:
    _set_job_status(job, JobStatus.canceled)
    job.completed_at = at
    for record in job.stages:
        if record.status in (StageStatus.pending, StageStatus.queued, StageStatus.running):
            record.status = StageStatus.canceled
            record.finished_at = at if record.started_at is not None else None
    job.stage = None
    job.progress = None
    return [_event(job, "job.canceled", at, reason=reason)]
