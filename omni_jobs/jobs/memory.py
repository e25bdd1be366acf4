"""MemoryJobStore: the JobStore contract kept in this process's memory, for running without Redis.

The in-process runner (``omni_jobs.Omni``) uses it so that a notebook, a test or a benchmark needs
no service at all. It is a second backend of the same interface, not a stand-in: jobs are kept as
JSON documents (a reader gets its own copy, as from Redis), ``update`` applies a mutation to a
copy and commits it atomically under a lock (a mutation that raises writes nothing), events get
increasing stream ids and can be waited for, and ``claim_enqueue`` is true once per (job, stage).
Jobs live as long as the process; there is no expiry.
"""

from __future__ import annotations

import threading
from typing import Any, cast

from omni_jobs.errors import JobNotFound
from omni_jobs.jobs.models import Job, JobEvent, JobStatus
from omni_jobs.jobs.store import JobPage, JobStore, Mutation


def _stream_id(seq: int) -> str:
    return f"{seq}-0"


def _seq(stream_id: str) -> int:
    head = stream_id.split("-", 1)[0]
    return int(head) if head.isdigit() else 0


class MemoryJobStore(JobStore):
    """Jobs and their event streams in a dict, safe for the threads of one process."""

    def __init__(self, *, ttl_s: int = 7 * 24 * 3600, events_maxlen: int = 2000) -> None:
        super().__init__(cast(Any, None), ttl_s=ttl_s, events_maxlen=events_maxlen)  # no Redis client
        self._jobs: dict[str, str] = {}
        self._order: list[str] = []
        self._events: dict[str, list[tuple[int, str]]] = {}
        self._claims: set[tuple[str, str]] = set()
        self._seq = 0
        self._changed = threading.Condition()

    # --- reading ---
    def get(self, job_id: str) -> Job | None:
        with self._changed:
            raw = self._jobs.get(job_id)
        return Job.model_validate_json(raw) if raw is not None else None

    def page(self, *, limit: int, cursor: str | None = None, status: JobStatus | None = None,
             tenant: str | None = None) -> JobPage:
        """Newest first; the cursor is an offset into the newest-first order, as with Redis."""
        start = int(cursor) if cursor and cursor.isdigit() else 0
        with self._changed:
            ids = list(reversed(self._order))
        jobs: list[Job] = []
        position = start
        while position < len(ids) and len(jobs) < limit:
            job = self.get(ids[position])
            position += 1
            if job is not None and (status is None or job.status is status) and tenant in (None, job.tenant):
                jobs.append(job)
        return JobPage(jobs, str(position) if position < len(ids) else None)

    def events(self, job_id: str, *, after: str = "0-0", block_ms: int | None = None, count: int = 100) -> list[JobEvent]:
        """Events after stream id ``after``; waits up to ``block_ms`` for new ones when asked."""
        after_seq = _seq(after)

        def newer() -> list[tuple[int, str]]:
            return [(s, raw) for s, raw in self._events.get(job_id, []) if s > after_seq][:count]

        with self._changed:
            found = newer()
            if not found and block_ms:
                self._changed.wait_for(lambda: bool(newer()), timeout=block_ms / 1000)
                found = newer()
        events = []
        for seq, raw in found:
            event = JobEvent.model_validate_json(raw)
            event.id = _stream_id(seq)
            events.append(event)
        return events

    # --- writing ---
    def create(self, job: Job, events: list[JobEvent]) -> None:
        with self._changed:
            if job.id not in self._jobs:
                self._order.append(job.id)
            self._jobs[job.id] = job.model_dump_json()
            self._append(job.id, events)
        self._notify(job, events)

    def update(self, job_id: str, mutate: Mutation) -> tuple[Job, list[JobEvent]]:
        """Apply ``mutate`` atomically; it may raise to abort without writing."""
        with self._changed:
            raw = self._jobs.get(job_id)
            if raw is None:
                raise JobNotFound(job_id)
            job = Job.model_validate_json(raw)
            events = mutate(job)
            self._jobs[job_id] = job.model_dump_json()
            self._append(job_id, events)
        self._notify(job, events)
        return job, events

    def queue_position(self, job: Job) -> int | None:
        """No queues in one process: a step runs as soon as the one before it ends."""
        return None

    def claim_enqueue(self, job_id: str, stage_id: str) -> bool:
        with self._changed:
            if (job_id, stage_id) in self._claims:
                return False
            self._claims.add((job_id, stage_id))
            return True

    def delete(self, job_id: str) -> None:
        with self._changed:
            self._jobs.pop(job_id, None)
            self._events.pop(job_id, None)
            self._order = [i for i in self._order if i != job_id]
            self._claims = {c for c in self._claims if c[0] != job_id}

    def _append(self, job_id: str, events: list[JobEvent]) -> None:
        """Caller holds the lock. Keeps the newest ``events_maxlen`` events, as the Redis stream does."""
        stream = self._events.setdefault(job_id, [])
        for event in events:
            self._seq += 1
            stream.append((self._seq, event.model_dump_json(exclude={"id"})))
        del stream[: max(0, len(stream) - self.events_maxlen)]
        if events:
            self._changed.notify_all()
