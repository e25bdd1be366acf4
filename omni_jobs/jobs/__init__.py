"""Jobs: the Job model, its state machine, the stores that keep it and the ledger that changes it."""

from omni_jobs.jobs.models import (
    FINAL_STATUSES,
    Job,
    JobError,
    JobEvent,
    JobOutput,
    JobStatus,
    StageRecord,
    StageStatus,
)
from omni_jobs.jobs.store import JobPage, JobStore

__all__ = [
    "FINAL_STATUSES",
    "Job",
    "JobError",
    "JobEvent",
    "JobOutput",
    "JobPage",
    "JobStatus",
    "JobStore",
    "StageRecord",
    "StageStatus",
]
