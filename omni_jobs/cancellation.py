"""Canceling a job: the status changes at once; workers see it at their next step and stop.

A queued stage that a worker takes later finds the job final and does nothing; a running DiT
stage stops at its next denoising step (the progress callback raises JobCanceled).
"""

from __future__ import annotations

from omni_jobs.errors import JobAlreadyFinished
from omni_jobs.jobs import state
from omni_jobs.jobs.models import Job, JobEvent, now
from omni_jobs.jobs.store import JobStore


def cancel_job(store: JobStore, job_id: str, reason: str = "canceled by request") -> Job:
    def mutate(job: Job) -> list[JobEvent]:
        if job.status.is_final:
            raise JobAlreadyFinished(job.id, job.status.value)
        return state.job_canceled(job, now(), reason)

    job, _ = store.update(job_id, mutate)
    return job
