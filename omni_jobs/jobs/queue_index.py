"""Queue positions: which waiting stages are ahead of a job's stage on its queue.

The broker's lists hold opaque messages, so the store keeps its own index, a sorted set per queue
of waiting ``<job>:<stage>`` members scored by queued time, changed in the same transaction as
the job (from the job's events): a position is never out of step with the job's status.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from omni_jobs import keys
from omni_jobs.jobs.models import Job, JobEvent, StageStatus, now

_FINAL_EVENTS = frozenset({"job.succeeded", "job.failed", "job.canceled"})


def _member(job_id: str, stage_id: str) -> str:
    return f"{job_id}:{stage_id}"


def track(pipe: redis.client.Pipeline, job: Job, events: Iterable[JobEvent], *, ttl_s: int) -> None:
    """Queue the index changes that ``events`` imply onto ``pipe`` (inside the job's transaction)."""
    for event in events:
        stage_id = event.data.get("stage")
        if event.type == "stage.queued" and isinstance(stage_id, str):
            key = keys.queue_waiting(job.stage_record(stage_id).queue)
            pipe.zadd(key, {_member(job.id, stage_id): event.at})
            # Members of jobs that expired while waiting would otherwise stay forever.
            pipe.zremrangebyscore(key, "-inf", now() - ttl_s)
        elif event.type in ("stage.started", "stage.succeeded") and isinstance(stage_id, str):
            pipe.zrem(keys.queue_waiting(job.stage_record(stage_id).queue), _member(job.id, stage_id))
        elif event.type in _FINAL_EVENTS:
            for record in job.stages:
                pipe.zrem(keys.queue_waiting(record.queue), _member(job.id, record.id))


def position(client: redis.Redis, job: Job) -> int | None:
    """1-based place of the job's waiting stage on its queue (1 = next to start); None when none waits."""
    waiting = [r for r in job.stages if r.status is StageStatus.queued]
    if job.status.is_final or not waiting:
        return None
    record = min(waiting, key=lambda r: r.queued_at or 0.0)
    rank = client.zrank(keys.queue_waiting(record.queue), _member(job.id, record.id))
    return None if rank is None else int(rank) + 1  # type: ignore[arg-type]
