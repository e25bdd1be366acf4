"""Canceling a job: the status changes at once; workers see it at their next step and stop.

A queued stage that a worker takes later finds the job final and does nothing; a running stage
stops at its next denoising step or token (its progress write finds the job canceled). The
``completed`` webhook, if any, is dispatched in the same write as the cancel.
"""

from __future__ import annotations

from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import Job


def cancel_job(ledger: JobLedger, job_id: str, reason: str = "canceled by request") -> Job:
    """The canceled job; JobAlreadyFinished if it ended already, JobNotFound if unknown."""
    return ledger.cancel(job_id, reason)
