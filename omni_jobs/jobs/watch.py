"""Following a job as it changes, without polling: its Redis event stream read with blocking XREAD.

Async (redis.asyncio) because its readers hold a request open for a long time: the SSE route
streams a job's events until it ends, and ``Prefer: wait=N`` blocks a POST until the job ends.
Thousands of such waits cost the API an open socket each, not a thread each.

A follower also marks the job as followed (``keys.job_followed``, with a TTL it renews); a GET of a
job not yet ended marks it looked at (``mark_looked_at``), unless a stream's mark is there. Workers
publish a running stage's text deltas only for followed jobs, and write its progress often only for
followed or looked-at ones (``job_readers``, omni_jobs.jobs.followed).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Sequence

import redis
import redis.asyncio as aioredis

from omni_jobs.core import keys
from omni_jobs.core.redis_clients import async_client_from_url
from omni_jobs.jobs import codec
from omni_jobs.jobs.followed import LOOK, LOOKED_AT_TTL_S, STREAM, Readers
from omni_jobs.jobs.models import FINAL_EVENTS, Job, JobEvent
from omni_jobs.jobs.redis_store import parse_stream

__all__ = ["FOLLOWED_TTL_S", "MAX_BLOCK_S", "STREAM_ID", "JobWatcher", "job_readers", "mark_looked_at"]

MAX_BLOCK_S = 15.0
"""Longest blocking read; callers' heartbeats and waits are cut into pieces no longer than this."""
FOLLOWED_TTL_S = 2 * MAX_BLOCK_S + 5
"""How long a follower's mark lasts: ``follow`` renews it before a read once MAX_BLOCK_S has passed,
so at most two reads' time apart, and it outlives that."""
STREAM_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
"""A Redis stream entry id: what SSE sends as ``id:`` and takes back as Last-Event-ID."""


class JobWatcher:
    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client

    @classmethod
    def from_url(cls, url: str, *, max_connections: int | None = None) -> JobWatcher:
        """``max_connections``: the pool's bound (each follower holds one while it blocks; the API
        caps its followers: api.streams)."""
        # The socket timeout must outlast the longest blocking XREAD (heartbeat, at most MAX_BLOCK_S).
        return cls(async_client_from_url(url, socket_timeout=MAX_BLOCK_S + 15, max_connections=max_connections))

    async def get(self, job_id: str) -> Job | None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.job(job_id))
            pipe.get(keys.job_progress(job_id))
            pipe.lrange(keys.job_deliveries(job_id), 0, -1)
            fields, progress, deliveries = await pipe.execute()
        return codec.decode(fields, progress, deliveries)

    async def events(self, job_id: str, *, after: str = "0-0", block_ms: int | None = None,
                     count: int = 100) -> list[JobEvent]:
        """Events after stream id ``after``; waits up to ``block_ms`` (> 0) for new ones when asked."""
        return parse_stream(await self.redis.xread({keys.job_events(job_id): after}, count=count, block=block_ms))

    async def follow(self, job_id: str, *, after: str = "0-0", heartbeat_s: float = 15.0
                     ) -> AsyncIterator[JobEvent | None]:
        """The job's events after ``after`` until its final one; ``None`` after each quiet ``heartbeat_s``.

        Ends at the final event, or when the job is final (or gone) and no event is left to read.
        """
        block_ms = max(1, int(min(heartbeat_s, MAX_BLOCK_S) * 1000))
        marked = float("-inf")
        while True:
            if time.monotonic() - marked > MAX_BLOCK_S:  # a reader follows: text stages publish as they go
                await self.redis.set(keys.job_followed(job_id), STREAM, ex=int(FOLLOWED_TTL_S))
                marked = time.monotonic()
            batch = await self.events(job_id, after=after)
            if not batch:
                job = await self.get(job_id)
                if job is None or job.status.is_final:
                    # It may have ended between the read and the get: send what it wrote, then stop.
                    for event in await self.events(job_id, after=after):
                        yield event
                    return
                batch = await self.events(job_id, after=after, block_ms=block_ms)
                if not batch:
                    yield None
                    continue
            for event in batch:
                after = event.id
                yield event
                if event.type in FINAL_EVENTS:
                    return

    async def wait_final(self, job_id: str, timeout_s: float) -> Job | None:
        """The job once it is final, or as it is when ``timeout_s`` runs out (None if it is gone)."""
        deadline = time.monotonic() + timeout_s
        after = "0-0"
        while True:
            job = await self.get(job_id)
            remaining = deadline - time.monotonic()
            if job is None or job.status.is_final or remaining <= 0:
                return job
            batch = await self.events(job_id, after=after, block_ms=max(1, int(min(remaining, 5.0) * 1000)))
            if batch:
                after = batch[-1].id

    async def aclose(self) -> None:
        await self.redis.aclose()


def job_readers(client: redis.Redis, job_ids: Sequence[str]) -> Readers:
    """Which of these jobs a stream follows (``JobWatcher.follow`` marks them), and which a client
    looked at otherwise (``mark_looked_at``, a cancel): one MGET."""
    if not job_ids:
        return Readers(set(), set())
    marks = client.mget([keys.job_followed(job_id) for job_id in job_ids])
    followed = {job_id for job_id, mark in zip(job_ids, marks, strict=True) if mark == STREAM}
    looked_at = {job_id for job_id, mark in zip(job_ids, marks, strict=True) if mark is not None and mark != STREAM}
    return Readers(followed, looked_at)


def mark_looked_at(client: redis.Redis, job_id: str) -> None:
    """A client looked at a job not yet ended (a poll): its running stages write their progress often
    for the next ``LOOKED_AT_TTL_S``. Only a missing mark is written: a poller writes once per TTL,
    and a stream's mark stays as it is."""
    client.set(keys.job_followed(job_id), LOOK, ex=LOOKED_AT_TTL_S, nx=True)
