"""Jobs: the Job model, its state machine, the stores that keep it and the ledger that changes it.

The models load with the package; the store (Redis) loads when ``JobStore`` or ``JobPage`` is first
used, so the job models stay light for the HTTP client (omni_jobs.jobs.view).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from omni_jobs.jobs.store import JobPage, JobStore


def __getattr__(name: str) -> object:
    """Load the store on first use (PEP 562)."""
    if name in ("JobPage", "JobStore"):
        from omni_jobs.jobs import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
