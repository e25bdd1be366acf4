"""MemoryJobStore: the JobStore contract in this process's memory, for running with no services.

The in-process runner (``omni_jobs.Omni``) uses it, so that a notebook, a test or a benchmark needs
no Redis. It keeps the same layout as Redis (hashes, sorted sets, streams, lists under the same
key names) and applies a Change's guards and writes under one lock, with the same semantics as the
Lua script; the contract tests (tests/contract) run against both. Keys expire: their TTLs are kept
and checked when read.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar, assert_never, cast

from omni_jobs.core import keys
from omni_jobs.jobs import codec
from omni_jobs.jobs.change import Change, Conflict, Op, OutboxEntry, ReleasePass
from omni_jobs.jobs.flows import Commit, CommitPlaced, Get, Idempotency, Oldest, Operation, QueuePosition
from omni_jobs.jobs.models import Job, JobEvent, JobStatus
from omni_jobs.jobs.steps import from_json, stage_slot
from omni_jobs.jobs.store import (
    IdempotencyRecord,
    JobPage,
    WebhookSlot,
    decode_webhook_slots,
    estimate_position,
    job_pending_steps,
    waiting_stage,
)

T = TypeVar("T")


class MemoryJobStore:
    """Jobs, events, outbox and indexes in dicts, safe for the threads of one process."""

    def __init__(self, *, ttl_s: int = 7 * 24 * 3600, events_maxlen: int = 2000) -> None:
        self.ttl_s = ttl_s
        self.events_maxlen = events_maxlen
        self._hashes: dict[str, dict[str, str]] = {}
        self._strings: dict[str, str] = {}
        self._zsets: dict[str, dict[str, float]] = {}
        self._streams: dict[str, list[tuple[int, str]]] = {}
        self._lists: dict[str, list[str]] = {}
        self._sets: dict[str, set[str]] = {}
        self._expiry: dict[str, float] = {}
        self._seq = itertools.count(1)
        self._changed = threading.Condition()

    # --- the key space (caller holds the lock) ---
    def _alive(self, key: str) -> bool:
        at = self._expiry.get(key)
        if at is not None and at <= time.time():
            self._drop(key)
            return False
        return True

    def _drop(self, key: str) -> None:
        self._hashes.pop(key, None)
        self._strings.pop(key, None)
        self._zsets.pop(key, None)
        self._streams.pop(key, None)
        self._lists.pop(key, None)
        self._sets.pop(key, None)
        self._expiry.pop(key, None)

    def _hash(self, key: str) -> dict[str, str]:
        return dict(self._hashes.get(key, {})) if self._alive(key) else {}

    def _string(self, key: str) -> str | None:
        return self._strings.get(key) if self._alive(key) else None

    def _zset(self, key: str) -> dict[str, float]:
        return self._zsets.get(key, {}) if self._alive(key) else {}

    @staticmethod
    def _ordered(zset: dict[str, float]) -> list[tuple[str, float]]:
        return sorted(zset.items(), key=lambda item: (item[1], item[0]))

    # --- reading ---
    def _read(self, job_id: str) -> Job | None:
        return codec.decode(self._hash(keys.job(job_id)), self._string(keys.job_progress(job_id)),
                            list(self._lists.get(keys.job_deliveries(job_id), [])))

    def get(self, job_id: str) -> Job | None:
        return self.run(Get(job_id))

    def get_many(self, job_ids: Sequence[str]) -> list[Job | None]:
        with self._changed:
            return [self._read(job_id) for job_id in job_ids]

    def page(self, *, limit: int, cursor: str | None = None, status: JobStatus | None = None,
             tenant: str | None = None) -> JobPage:
        """Newest first; the cursor is an offset into the newest-first index, as with Redis."""
        if status is not None:
            index = keys.jobs_by_status(status.value, tenant)
        else:
            index = keys.JOBS_INDEX if tenant is None else keys.tenant_jobs(tenant)
        position = int(cursor) if cursor and cursor.isascii() and cursor.isdigit() else 0  # '²'.isdigit()
        with self._changed:
            ids = [m for m, _ in reversed(self._ordered(self._zset(index)))]
            jobs: list[Job] = []
            while position < len(ids) and len(jobs) < limit:
                job = self._read(ids[position])
                position += 1
                if job is not None and (status is None or job.status is status):
                    jobs.append(job)
        return JobPage(jobs, str(position) if position < len(ids) else None)

    def events(self, job_id: str, *, after: str = "0-0", block_ms: int | None = None,
               count: int = 100) -> list[JobEvent]:
        after_seq = int(after.split("-", 1)[0]) if after.split("-", 1)[0].isascii() and after.split("-", 1)[0].isdigit() else 0
        stream_key = keys.job_events(job_id)

        def newer() -> list[tuple[int, str]]:
            return [(s, raw) for s, raw in self._streams.get(stream_key, []) if s > after_seq][:count]

        with self._changed:
            found = newer()
            if not found and block_ms:
                self._changed.wait_for(lambda: bool(newer()), timeout=block_ms / 1000)
                found = newer()
        events = []
        for seq, raw in found:
            event = JobEvent.model_validate_json(raw)
            event.id = f"{seq}-0"
            events.append(event)
        return events

    def webhook_slots(self, job_id: str) -> dict[str, WebhookSlot]:
        with self._changed:
            return decode_webhook_slots(self._hash(keys.job_webhooks(job_id)))

    def idempotency(self, tenant: str, key: str) -> IdempotencyRecord | None:
        return self.run(Idempotency(tenant, key))

    # --- the one way to write ---
    def commit(self, change: Change) -> Conflict | None:
        return self.run(Commit(change))

    def _commit(self, change: Change) -> Conflict | None:
        with self._changed:
            for guard in change.guards:
                found = self._hash(guard.key).get(guard.field)
                if found not in guard.allowed:
                    return Conflict(guard, found)
            for cap in change.caps:
                since = float("-inf") if cap.since is None else cap.since
                count = sum(1 for score in self._zset(cap.key).values() if score >= since)
                if count >= cap.below:
                    return Conflict(None, str(count), cap=cap)
            for op in change.ops:
                self._apply(op)
            if change.events:
                self._changed.notify_all()
        return None

    def commit_each(self, changes: Sequence[Change]) -> list[Conflict | None]:
        return [self.commit(c) for c in changes]

    def _apply(self, op: Op) -> None:
        key = op[1]
        if op[0] != "del":
            self._alive(key)
        match op:
            case ("hset", _, mapping):
                self._hashes.setdefault(key, {}).update(mapping)
            case ("hdel", _, names):
                fields = self._hashes.get(key, {})
                for name in names:
                    fields.pop(name, None)
                if not fields:
                    self._hashes.pop(key, None)
            case ("del", _):
                self._drop(key)
            case ("set", _, value, ttl_s):
                self._strings[key] = value
                if ttl_s > 0:
                    self._expiry[key] = time.time() + ttl_s
                else:
                    self._expiry.pop(key, None)
            case ("expire", _, ttl_s):
                if any(key in space for space in (self._hashes, self._strings, self._zsets, self._streams,
                                                   self._lists)):
                    self._expiry[key] = time.time() + ttl_s
            case ("zadd", _, member, score):
                self._zsets.setdefault(key, {})[member] = float(score)
            case ("zaddnx", _, member, score):
                self._zsets.setdefault(key, {}).setdefault(member, float(score))
            case ("zrem", _, member):
                self._zsets.get(key, {}).pop(member, None)
            case ("ztrim", _, max_score):
                zset = self._zsets.get(key, {})
                for member in [m for m, score in zset.items() if score <= max_score]:
                    del zset[member]
            case ("sadd", _, member):
                self._sets.setdefault(key, set()).add(member)
            case ("xadd", _, maxlen, payload):
                stream = self._streams.setdefault(key, [])
                stream.append((next(self._seq), payload))
                del stream[: max(0, len(stream) - maxlen)]
            case ("rpush", _, value, keep_last):
                values = self._lists.setdefault(key, [])
                values.append(value)
                del values[: max(0, len(values) - keep_last)]
            case _:
                assert_never(op)

    # --- outbox ---
    def claim_outbox(self, *, now: float, limit: int, hold_s: float, job_id: str | None = None) -> list[OutboxEntry]:
        entries: list[OutboxEntry] = []
        with self._changed:
            outbox, items = self._zsets.setdefault(keys.OUTBOX, {}), self._hashes.setdefault(keys.OUTBOX_ITEMS, {})
            for entry_id, due in self._ordered(outbox):
                if due > now or len(entries) >= limit:
                    break
                if job_id is not None and f":{job_id}:" not in entry_id:
                    continue
                if entry_id not in items:
                    outbox.pop(entry_id)
                    continue
                outbox[entry_id] = now + hold_s
                entries.append(OutboxEntry(from_json(items[entry_id]), now))
        return entries

    def ack_outbox(self, ids: Sequence[str]) -> None:
        with self._changed:
            for entry_id in ids:
                self._zsets.get(keys.OUTBOX, {}).pop(entry_id, None)
                self._hashes.get(keys.OUTBOX_ITEMS, {}).pop(entry_id, None)

    def outbox_holds(self, ids: Sequence[str]) -> set[str]:
        with self._changed:
            outbox = self._zsets.get(keys.OUTBOX, {})
            return {i for i in ids if i in outbox}

    def next_outbox_due(self) -> float | None:
        with self._changed:
            ordered = self._ordered(self._zsets.get(keys.OUTBOX, {}))
        return ordered[0][1] if ordered else None

    # --- leases and queues ---
    def expired_leases(self, *, now: float, limit: int) -> list[str]:
        with self._changed:
            ordered = self._ordered(self._zset(keys.LEASES))
        return [m for m, s in ordered if s <= now][:limit]

    def leased_slots(self) -> list[str]:
        with self._changed:
            return [m for m, _ in self._ordered(self._zset(keys.LEASES))]

    def released(self, queue: str, *, before: float, limit: int) -> list[str]:
        with self._changed:
            ordered = self._ordered(self._zset(keys.queue_released(queue)))
        return [m for m, s in ordered if s <= before][:limit]

    def release(self, windows: Mapping[str, int], *, now: float, limit: int = 100) -> ReleasePass:
        """The same pass as RedisJobStore.release, under the lock."""
        out: list[tuple[str, str]] = []
        full: set[str] = set()
        for queue, window in windows.items():
            released, left_full = self._release_queue(queue, window, now, limit)
            out += released
            if left_full:
                full.add(queue)
        return ReleasePass(out, frozenset(full))

    def release_and_claim(self, windows: Mapping[str, int], *, now: float, limit: int,
                          hold_s: float) -> tuple[ReleasePass, list[OutboxEntry]]:
        """``release``, then ``claim_outbox`` (one script on Redis; two steps under the lock here)."""
        done = self.release(windows, now=now, limit=limit)
        entries = self.claim_outbox(now=now, limit=limit, hold_s=hold_s)
        return replace(done, next_due=self.next_outbox_due()), entries

    def _release_queue(self, queue: str, window: int, now: float, limit: int) -> tuple[list[tuple[str, str]], bool]:
        """(released, whether the window is left full)."""
        out: list[tuple[str, str]] = []
        with self._changed:
            tenants = self._zsets.setdefault(keys.queue_tenants(queue), {})
            released = self._zsets.setdefault(keys.queue_released(queue), {})
            in_service = len(released) + len(self._zset(keys.queue_running(queue)))
            items = self._hashes.get(keys.OUTBOX_ITEMS, {})
            while in_service < window and len(out) < limit and tenants:
                tenant = self._ordered(tenants)[0][0]
                ready = self._zsets.setdefault(keys.queue_ready(queue, tenant), {})
                if ready:
                    entry_id = self._ordered(ready)[0][0]
                    del ready[entry_id]
                    if entry_id in items:
                        self._zsets.setdefault(keys.OUTBOX, {})[entry_id] = now
                        released[entry_id.rsplit(":", 1)[0]] = now + len(out) * 1e-6  # release order
                        in_service += 1
                        out.append((entry_id, tenant))
                if ready:
                    tenants[tenant] = now
                else:
                    del tenants[tenant]
        return out, in_service >= window

    def scheduled_queues(self) -> list[str]:
        with self._changed:
            return sorted(self._sets.get(keys.SCHEDULED_QUEUES, set()))

    def oldest(self, key: str, *, since: float) -> float | None:
        return self.run(Oldest(key, since))

    def count(self, key: str) -> int:
        with self._changed:
            return len(self._zset(key))

    def queue_counts(self, queue: str) -> tuple[int, int]:
        with self._changed:
            return len(self._zset(keys.queue_waiting(queue))), len(self._zset(keys.queue_running(queue)))

    def queue_position(self, job: Job) -> int | None:
        return self.run(QueuePosition(job))

    def try_lock(self, name: str, owner: str, ttl_s: float) -> bool:
        with self._changed:
            if self._string(name) is not None:
                return False
            self._apply(("set", name, owner, 0))
            self._expiry[name] = time.time() + ttl_s
            return True

    def throttle(self, name: str, interval_s: float) -> bool:
        return interval_s <= 0 or self.try_lock(keys.throttle(name), "1", interval_s)

    # --- retention ---
    def job_ids_created(self, *, after: float | None, until: float) -> list[str]:
        with self._changed:
            ordered = self._ordered(self._zset(keys.JOBS_INDEX))
        scores = [s for _, s in ordered]
        start = 0 if after is None else bisect.bisect_right(scores, after)
        return [m for m, s in ordered[start:] if s <= until]

    def overdue(self, *, now: float, limit: int) -> list[str]:
        with self._changed:
            return [m for m, s in self._ordered(self._zset(keys.DEADLINES)) if s <= now][:limit]

    def delete(self, job_id: str) -> None:
        with self._changed:
            fields = self._hash(keys.job(job_id))
            pending = job_pending_steps(job_id, fields, self._hash(keys.job_webhooks(job_id)))
            tenant = fields.get("tenant")
            for key in (keys.job(job_id), keys.job_events(job_id), keys.job_progress(job_id),
                        keys.job_webhooks(job_id), keys.job_deliveries(job_id)):
                self._drop(key)
            self._zsets.get(keys.JOBS_INDEX, {}).pop(job_id, None)
            self._zsets.get(keys.DEADLINES, {}).pop(job_id, None)
            if tenant is not None:
                self._zsets.get(keys.tenant_jobs(tenant), {}).pop(job_id, None)
                self._zsets.get(keys.tenant_active(tenant), {}).pop(job_id, None)
            if "status" in fields:
                for who in (None, tenant):
                    self._zsets.get(keys.jobs_by_status(fields["status"], who), {}).pop(job_id, None)
            for queue, slot, entry_id in pending:
                for index in (keys.queue_waiting(queue), keys.queue_running(queue), keys.queue_released(queue),
                              keys.LEASES, keys.OUTBOX):
                    self._zsets.get(index, {}).pop(entry_id if index == keys.OUTBOX else slot, None)
                if tenant is not None:
                    self._zsets.get(keys.queue_ready(queue, tenant), {}).pop(entry_id, None)
                self._hashes.get(keys.OUTBOX_ITEMS, {}).pop(entry_id, None)

    def get_mark(self, name: str) -> str | None:
        with self._changed:
            return self._string(name)

    def set_mark(self, name: str, value: str) -> None:
        with self._changed:
            self._apply(("set", name, value, 0))

    # --- the operations of a flow (omni_jobs.jobs.flows) ---
    def run(self, op: Operation[T]) -> T:
        return cast(T, self._answer(op))

    async def arun(self, op: Operation[T]) -> T:
        """``run``: nothing here waits on I/O, so it only holds the lock briefly."""
        return cast(T, self._answer(op))

    def _answer(self, op: Operation[Any]) -> object:
        with self._changed:  # reentrant: a placed commit and its read of the position under one hold, as in Redis
            if isinstance(op, Commit):
                return self._commit(op.change)
            if isinstance(op, CommitPlaced):
                conflict = self._commit(op.change)
                return conflict, (self._queue_position(op.job) if conflict is None else None)
            if isinstance(op, Get):
                return self._read(op.job_id)
            if isinstance(op, Idempotency):
                return IdempotencyRecord.of(self._hash(keys.idempotency(op.tenant, op.key)))
            if isinstance(op, QueuePosition):
                return self._queue_position(op.job)
            if isinstance(op, Oldest):
                scores = [s for s in self._zset(op.key).values() if s >= op.since]
                return min(scores) if scores else None
        raise TypeError(f"a job store answers no {type(op).__name__}")

    def _queue_position(self, job: Job) -> int | None:
        record = waiting_stage(job)
        if record is None:
            return None
        slot = stage_slot(job.id, record.id)
        entry = f"{slot}:{record.attempts + 1}"

        def rank(key: str, member: str) -> int | None:
            ordered = [m for m, _ in self._ordered(self._zset(key))]
            return ordered.index(member) if member in ordered else None

        return estimate_position([rank(keys.queue_released(record.queue), slot),
                                  len(self._zset(keys.queue_released(record.queue))),
                                  rank(keys.queue_ready(record.queue, job.tenant), entry),
                                  len(self._zset(keys.queue_tenants(record.queue)))])

    async def aclose(self) -> None:
        return None
