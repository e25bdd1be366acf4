"""Retention: remove what has outlived its TTL, and end jobs that passed their deadline.

Job documents and Redis intermediates expire by themselves (Redis TTLs). What does not expire by
itself — outputs and large intermediates in S3 or on disk, the jobs index, jobs nobody picked up
before their deadline — is removed here. Run it periodically (`omni-jobs cleanup`, or the
`omni.cleanup` Celery task from beat); every step is idempotent, so overlapping runs are safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from omni_jobs.artifacts import ArtifactStore
from omni_jobs.core import keys
from omni_jobs.dispatch.cancellation import cancel_overdue
from omni_jobs.dispatch.leases import Reaper
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import now

log = logging.getLogger(__name__)


@dataclass
class CleanupReport:
    jobs_expired: int = 0
    artifacts_deleted: int = 0
    intermediates_deleted: int = 0
    deadlines_canceled: int = 0
    steps_requeued: int = 0
    steps_redispatched: int = 0


def cleanup(ledger: JobLedger, artifacts: ArtifactStore, *, output_ttl_s: float, intermediate_ttl_s: float,
            at: float | None = None, reaper: Reaper | None = None) -> CleanupReport:
    """One retention pass; with ``reaper``, also one reaper pass (lost workers' steps come back)."""
    at = now() if at is None else at
    report = CleanupReport()
    store = ledger.store

    # 1. Jobs past the output TTL: their files go, then the job and its index entry.
    for job_id in store.job_ids_created(after=None, until=at - output_ttl_s):
        report.artifacts_deleted += artifacts.delete_job(job_id)
        store.delete(job_id)
        report.jobs_expired += 1

    # 2. Finished jobs past the intermediate TTL: drop what stages handed each other.
    mark_raw = store.get_mark(keys.RETENTION_MARK)
    mark = float(mark_raw) if mark_raw is not None else None
    horizon = at - intermediate_ttl_s
    for job_id in store.job_ids_created(after=mark, until=horizon):
        job = store.get(job_id)
        if job is not None and not job.status.is_final:
            horizon = min(horizon, job.created_at - 1e-6)  # still running: come back to it next time
            continue
        report.intermediates_deleted += artifacts.delete_job_intermediates(job_id)
    store.set_mark(keys.RETENTION_MARK, repr(max(horizon, mark) if mark is not None else horizon))

    # 3. Unfinished jobs past their deadline (e.g. never picked up because no worker ran); every
    # worker's reaper does it too, within seconds (omni_jobs.dispatch.leases).
    report.deadlines_canceled = len(cancel_overdue(ledger, at=at, limit=10_000))

    # 4. Steps whose worker died, when no worker is left to notice.
    if reaper is not None:
        reaped = reaper.run_once()
        report.steps_requeued = reaped.requeued
        report.steps_redispatched = reaped.redispatched
    log.info("cleanup: %s", report)
    return report
