"""Steps taken from the outbox as the relay takes them, for tests that run a job's steps themselves.

Tests that drive a StageRunner (or the results step) by hand, with no relay and no workers, take each
step the ledger dispatched from the outbox, run it, and take the next ones.
"""

from __future__ import annotations

from omni_jobs.dispatch.scheduling import Scheduler
from omni_jobs.jobs.models import now
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import Step


def due_steps(store: RedisJobStore, job_id: str, *, at: float | None = None) -> list[Step]:
    """The job's steps due by ``at`` (now), taken from the outbox and acknowledged, as the relay does.
    First attempts wait for their turn in the scheduler: they are released first."""
    Scheduler(store, None).release_all()
    entries = store.claim_outbox(now=now() if at is None else at, limit=100, hold_s=60.0, job_id=job_id)
    store.ack_outbox([e.id for e in entries])
    return [e.step for e in entries]
