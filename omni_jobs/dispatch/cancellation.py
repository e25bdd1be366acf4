"""Canceling a job: the status changes at once; workers see it at their next step and stop.

A queued stage that a worker takes later finds the job final and does nothing; a running stage
stops at its next denoising step or token (its progress write finds the job canceled). The
``completed`` webhook, if any, is dispatched in the same write as the cancel.
"""

from __future__ import annotations

from omni_jobs.core.errors import JobAlreadyFinished, JobNotFound
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import Job

DEADLINE_REASON = "deadline exceeded (cancel_after)"


def cancel_job(ledger: JobLedger, job_id: str, reason: str = "canceled by request") -> Job:
    """The canceled job; JobAlreadyFinished if it ended already, JobNotFound if unknown."""
    return ledger.cancel(job_id, reason)


def cancel_overdue(ledger: JobLedger, *, at: float, limit: int) -> list[str]:
    """Cancel the unfinished jobs whose Cancel-After deadline passed by ``at`` (from the deadline
    index); the ids it canceled. A running stage also notices its deadline itself; this is for jobs
    no worker is running, e.g. waiting on a queue that has none."""
    canceled: list[str] = []
    for job_id in ledger.store.overdue(now=at, limit=limit):
        job = ledger.store.get(job_id)
        if job is None or job.status.is_final or job.deadline_at is None or job.deadline_at > at:
            continue
        try:
            cancel_job(ledger, job_id, reason=DEADLINE_REASON)
        except (JobAlreadyFinished, JobNotFound):
            continue
        canceled.append(job_id)
    return canceled
