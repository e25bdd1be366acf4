"""JobStore: where job state lives. A Protocol with two implementations that pass the same tests:
``RedisJobStore`` (omni_jobs.jobs.redis_store) for every deployment, ``MemoryJobStore``
(omni_jobs.jobs.memory) for one process with no services; and what both of them read and answer.

A store reads (jobs, events, indexes) and applies Changes atomically; it decides nothing. The
decisions (which transition is legal, what it dispatches) are made once, in the ledger, for both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from omni_jobs.core import jsontext
from omni_jobs.jobs.change import Change, Conflict, OutboxEntry, ReleasePass
from omni_jobs.jobs.models import Job, JobEvent, JobStatus, StageRecord, StageStatus
from omni_jobs.jobs.steps import RESULTS_QUEUE, WEBHOOKS_QUEUE, results_slot, stage_slot, webhook_slot

if TYPE_CHECKING:
    from omni_jobs.jobs.flows import Operation

T = TypeVar("T")


@dataclass(frozen=True)
class JobPage:
    jobs: list[Job]
    next_cursor: str | None


@dataclass(frozen=True)
class WebhookSlot:
    """One webhook message of a job: its event, delivery status, attempts and lease."""

    message_id: str
    event: str
    status: str  # queued | sending | delivered | gave_up | rejected
    attempts: int
    lease_owner: str | None = None
    lease_until: float | None = None

    @property
    def pending(self) -> bool:
        """Queued or being sent: more attempts of it may still be recorded."""
        return self.status in ("queued", "sending")


def webhook_field(message_id: str, name: str) -> str:
    return f"{message_id}:{name}"


def decode_webhook_slots(raw: dict[str, str]) -> dict[str, WebhookSlot]:
    ids = {name.split(":", 1)[0] for name in raw}
    slots: dict[str, WebhookSlot] = {}
    for mid in sorted(ids):
        event, status = raw.get(webhook_field(mid, "event")), raw.get(webhook_field(mid, "status"))
        if event is None or status is None:
            continue
        until = raw.get(webhook_field(mid, "lease_until"))
        slots[mid] = WebhookSlot(mid, event, status, int(raw.get(webhook_field(mid, "attempts")) or 0),
                                 raw.get(webhook_field(mid, "lease_owner")), float(until) if until is not None else None)
    return slots


@dataclass(frozen=True)
class IdempotencyRecord:
    job_id: str
    fingerprint: str

    @classmethod
    def of(cls, raw: Mapping[str, str]) -> IdempotencyRecord | None:
        """The record from its hash's fields (None when it has none: never made, or expired)."""
        return cls(raw["job_id"], raw["fingerprint"]) if "job_id" in raw else None


class JobStore(Protocol):
    """What the ledger, the relay, the reaper, retention and the API read and write."""

    ttl_s: int
    events_maxlen: int

    # --- jobs and events ---
    def get(self, job_id: str) -> Job | None: ...
    def get_many(self, job_ids: Sequence[str]) -> list[Job | None]: ...
    def page(self, *, limit: int, cursor: str | None = None, status: JobStatus | None = None,
             tenant: str | None = None) -> JobPage: ...
    def events(self, job_id: str, *, after: str = "0-0", block_ms: int | None = None,
               count: int = 100) -> list[JobEvent]: ...
    def webhook_slots(self, job_id: str) -> dict[str, WebhookSlot]: ...
    def idempotency(self, tenant: str, key: str) -> IdempotencyRecord | None: ...

    # --- the one way to write ---
    def commit(self, change: Change) -> Conflict | None:
        """Apply ``change`` if all its guards hold (None), else write nothing and say which did not."""
        ...

    def commit_each(self, changes: Sequence[Change]) -> list[Conflict | None]:
        """``commit`` of each change on its own (one may be refused while the others apply), in one
        round trip: what a process does for all its leases at once (renewals, progress)."""
        ...

    # --- outbox, leases, queues ---
    def claim_outbox(self, *, now: float, limit: int, hold_s: float, job_id: str | None = None) -> list[OutboxEntry]:
        """Due entries, each held for ``hold_s`` (another claimer skips it meanwhile; after that it is due again)."""
        ...
    def ack_outbox(self, ids: Sequence[str]) -> None: ...
    def outbox_holds(self, ids: Sequence[str]) -> set[str]:
        """Which of these entry ids are still in the outbox (not yet published)."""
        ...
    def next_outbox_due(self) -> float | None: ...
    def expired_leases(self, *, now: float, limit: int) -> list[str]: ...
    def leased_slots(self) -> list[str]: ...
    def released(self, queue: str, *, before: float, limit: int) -> list[str]:
        """Step slots published (or due) on the queue before ``before`` that no worker started yet."""
        ...
    def release(self, windows: Mapping[str, int], *, now: float, limit: int = 100) -> ReleasePass:
        """The scheduler's pass over the queues in ``windows`` (queue -> window; see RedisJobStore.release)."""
        ...
    def release_and_claim(self, windows: Mapping[str, int], *, now: float, limit: int,
                          hold_s: float) -> tuple[ReleasePass, list[OutboxEntry]]:
        """``release``, then ``claim_outbox`` of everything due (what it released too), as one step."""
        ...
    def scheduled_queues(self) -> list[str]: ...
    def oldest(self, key: str, *, since: float) -> float | None:
        """The lowest score at or after ``since`` in sorted set ``key`` (a rate window's oldest entry)."""
        ...
    def count(self, key: str) -> int:
        """How many members sorted set ``key`` has (a tenant's jobs in flight)."""
        ...
    def queue_counts(self, queue: str) -> tuple[int, int]:
        """(waiting, running) step slots of a queue."""
        ...
    def queue_position(self, job: Job) -> int | None: ...
    def try_lock(self, name: str, owner: str, ttl_s: float) -> bool: ...
    def throttle(self, name: str, interval_s: float) -> bool:
        """True at most once per ``interval_s`` for ``name``, across all processes."""
        ...

    # --- retention ---
    def job_ids_created(self, *, after: float | None, until: float) -> list[str]: ...
    def overdue(self, *, now: float, limit: int) -> list[str]:
        """Unfinished jobs whose deadline passed (from the deadline index, not a walk over all jobs)."""
        ...
    def delete(self, job_id: str) -> None: ...
    def get_mark(self, name: str) -> str | None: ...
    def set_mark(self, name: str, value: str) -> None: ...

    # --- the operations of a flow (omni_jobs.jobs.flows): one sync and one async entry ---
    def run(self, op: Operation[T]) -> T:
        """Answer one operation on this thread (``flows.drive``); ``get``, ``commit``, ``idempotency``,
        ``queue_position`` and ``oldest`` are ``run`` of theirs."""
        ...

    async def arun(self, op: Operation[T]) -> T:
        """Answer one operation on the event loop, through this loop's async client, with the same
        commands and the same reading of the reply as ``run`` (``flows.adrive``: the API's submit path,
        one round trip each, no thread)."""
        ...

    async def aclose(self) -> None:
        """Close this event loop's async client (the API's shutdown)."""
        ...


def waiting_stage(job: Job) -> StageRecord | None:
    """The job's stage that waits longest, if one waits (what its queue position is about)."""
    waiting = [r for r in job.stages if r.status is StageStatus.queued]
    if job.status.is_final or not waiting:
        return None
    return min(waiting, key=lambda r: r.queued_at or 0.0)


def as_int(value: int | bytes | None) -> int:
    """A number of a script's reply, where the script never answers nil."""
    if value is None:
        raise ValueError("the commit script answered nil where it answers a number")
    return int(value)


def estimate_position(reads: Sequence[int | bytes | None]) -> int | None:
    """The position from the reads of ``_read_position`` (or the commit script): the step's rank among
    the released ones, their count, its rank in its tenant's ready steps, the tenants taking turns."""
    released_rank, released, ready_rank, tenants = reads
    if released_rank is not None:
        return int(released_rank) + 1
    if ready_rank is not None:
        return as_int(released) + int(ready_rank) * max(1, as_int(tenants)) + 1
    return None


def job_pending_steps(job_id: str, fields: dict[str, str], hooks: dict[str, str]) -> list[tuple[str, str, str]]:
    """(queue, slot, outbox id of its next attempt) of every step slot of a job (stages, results,
    webhook messages), from its hash fields: what deleting the job must also take off the indexes."""
    found: list[tuple[str, str, str]] = []
    for stage in jsontext.loads(fields.get("stages", "[]")):
        slot = stage_slot(job_id, stage["id"])
        attempts = int(fields.get(f"stage:{stage['id']}:attempts", "0"))
        found.append((stage["queue"], slot, f"{slot}:{attempts + 1}"))
    slot = results_slot(job_id)
    found.append((RESULTS_QUEUE, slot, f"{slot}:{int(fields.get('results:attempts', '0')) + 1}"))
    for message_id, slot_info in decode_webhook_slots(hooks).items():
        slot = webhook_slot(job_id, message_id)
        found.append((WEBHOOKS_QUEUE, slot, f"{slot}:{slot_info.attempts + 1}"))
    return found
