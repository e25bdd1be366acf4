"""JobStore: jobs as JSON documents in Redis, changed only by optimistic transactions.

Several workers and the API change one job concurrently (progress, stage results, cancel), so
every change is read-modify-write under WATCH: a lost update is retried, never silently dropped.
Each change appends its events to the job's Redis stream in the same transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from omni_jobs import keys
from omni_jobs.errors import JobNotFound
from omni_jobs.jobs import queue_index
from omni_jobs.jobs.models import Job, JobEvent, JobStatus

log = logging.getLogger(__name__)

Mutation = Callable[[Job], list[JobEvent]]
CommitListener = Callable[[Job, list[JobEvent]], None]
"""Called with the job and its new events after each committed change (e.g. the webhook notifier)."""


@dataclass(frozen=True)
class JobPage:
    jobs: list[Job]
    next_cursor: str | None


class JobStore:
    """Redis-backed store of jobs and their event streams."""

    def __init__(self, client: redis.Redis, *, ttl_s: int, events_maxlen: int = 2000) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self.events_maxlen = events_maxlen
        self.listeners: list[CommitListener] = []

    # --- reading ---
    def get(self, job_id: str) -> Job | None:
        raw = self.redis.get(keys.job(job_id))
        return Job.model_validate_json(raw) if raw is not None else None

    def require(self, job_id: str, *, tenant: str | None = None) -> Job:
        """The job; JobNotFound when unknown or, with ``tenant``, owned by another tenant (same answer)."""
        job = self.get(job_id)
        if job is None or (tenant is not None and job.tenant != tenant):
            raise JobNotFound(job_id)
        return job

    def page(self, *, limit: int, cursor: str | None = None, status: JobStatus | None = None,
             tenant: str | None = None) -> JobPage:
        """Newest first. The cursor is an opaque offset into the index (the tenant's own, when given)."""
        index = keys.JOBS_INDEX if tenant is None else keys.tenant_jobs(tenant)
        start = int(cursor) if cursor and cursor.isdigit() else 0
        jobs: list[Job] = []
        position = start
        batch = max(limit, 50)
        while len(jobs) < limit:
            ids: list[bytes] = self.redis.zrevrange(index, position, position + batch - 1)  # type: ignore[assignment]
            if not ids:
                return JobPage(jobs, None)
            raws: list[bytes | None] = self.redis.mget([keys.job(i.decode()) for i in ids])  # type: ignore[assignment]
            for raw_id, raw in zip(ids, raws, strict=True):
                position += 1
                if raw is None:  # expired: drop it from the index lazily
                    self.redis.zrem(index, raw_id)
                    position -= 1
                    continue
                job = Job.model_validate_json(raw)
                if status is None or job.status is status:
                    jobs.append(job)
                if len(jobs) == limit:
                    break
        more = self.redis.zcard(index) > position
        return JobPage(jobs, str(position) if more else None)

    def events(self, job_id: str, *, after: str = "0-0", block_ms: int | None = None, count: int = 100) -> list[JobEvent]:
        """Events after stream id ``after``; blocks up to ``block_ms`` for new ones when asked."""
        reply: Any = self.redis.xread({keys.job_events(job_id): after}, count=count, block=block_ms)
        events: list[JobEvent] = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                event = JobEvent.model_validate_json(fields[b"event"])
                event.id = entry_id.decode()
                events.append(event)
        return events

    # --- writing ---
    def create(self, job: Job, events: list[JobEvent]) -> None:
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.job(job.id), job.model_dump_json(), ex=self.ttl_s)
            pipe.zadd(keys.JOBS_INDEX, {job.id: job.created_at})
            pipe.zadd(keys.tenant_jobs(job.tenant), {job.id: job.created_at})
            self._append_events(pipe, job.id, events)
            queue_index.track(pipe, job, events, ttl_s=self.ttl_s)
            pipe.execute()
        self._notify(job, events)

    def update(self, job_id: str, mutate: Mutation) -> tuple[Job, list[JobEvent]]:
        """Apply ``mutate`` atomically; it may raise to abort without writing."""
        key = keys.job(job_id)
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    if raw is None:
                        raise JobNotFound(job_id)
                    job = Job.model_validate_json(raw)
                    events = mutate(job)
                    pipe.multi()
                    pipe.set(key, job.model_dump_json(), keepttl=True)
                    self._append_events(pipe, job_id, events)
                    queue_index.track(pipe, job, events, ttl_s=self.ttl_s)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        self._notify(job, events)
        return job, events

    def queue_position(self, job: Job) -> int | None:
        """Where the job's waiting stage stands on its queue (1 = next); None when no stage waits."""
        return queue_index.position(self.redis, job)

    def _notify(self, job: Job, events: list[JobEvent]) -> None:
        """Tell the listeners; a failing listener is logged and never undoes or fails the change."""
        if not events:
            return
        for listener in self.listeners:
            try:
                listener(job, events)
            except Exception:
                log.exception("job %s: commit listener %r failed", job.id, listener)

    def claim_enqueue(self, job_id: str, stage_id: str) -> bool:
        """True exactly once per (job, stage): guards fan-in stages and redelivered parents."""
        return bool(self.redis.set(keys.stage_enqueued(job_id, stage_id), b"1", nx=True, ex=self.ttl_s))

    def delete(self, job_id: str) -> None:
        job = self.get(job_id)
        self.redis.delete(keys.job(job_id), keys.job_events(job_id))
        self.redis.zrem(keys.JOBS_INDEX, job_id)
        if job is not None:
            self.redis.zrem(keys.tenant_jobs(job.tenant), job_id)

    def _append_events(self, pipe: redis.client.Pipeline, job_id: str, events: list[JobEvent]) -> None:
        stream = keys.job_events(job_id)
        for event in events:
            pipe.xadd(stream, {"event": event.model_dump_json(exclude={"id"})}, maxlen=self.events_maxlen, approximate=True)
        if events:
            pipe.expire(stream, self.ttl_s)
