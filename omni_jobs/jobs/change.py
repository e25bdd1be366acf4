"""One atomic change of job state: guards, then writes, applied all together or not at all.

A transition (omni_jobs.jobs.ledger) reads a job, decides, and expresses what it decided as a
Change: the field values its decision depended on (guards: compare-and-set on hash fields) and
the writes it makes (job fields, events, outbox entries, index entries). A store applies it in
one step: Redis with one Lua script, memory under one lock. If a guard no longer holds, nothing
is written and the transition reads again: optimistic concurrency in one round trip, with no
WATCH loop and no whole-document rewrite.

The writes are a small closed set of operations (below), so both stores implement exactly the
same semantics and the same contract tests hold for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from omni_jobs.core import jsontext, keys
from omni_jobs.jobs.models import JobEvent
from omni_jobs.jobs.steps import Step, step_id, to_json


@dataclass(frozen=True)
class Guard:
    """HGET key field must be one of ``allowed`` (None: the field is absent)."""

    key: str
    field: str
    allowed: tuple[str | None, ...]


@dataclass(frozen=True)
class Cap:
    """At most ``below - 1`` members of sorted set ``key`` may score ``since`` or later (None: any).
    A quota: a tenant's jobs in flight, its submissions in the last minute."""

    key: str
    below: int
    since: float | None = None
    name: str = ""
    """Which limit this is, for the refusal (e.g. ``max_active``)."""


@dataclass(frozen=True)
class Conflict:
    """The first guard that did not hold, and the value found instead (None: absent); or the cap
    that was reached (``guard`` is then None)."""

    guard: Guard | None
    found: str | None
    cap: Cap | None = None


@dataclass(frozen=True)
class ReleasePass:
    """What one scheduler pass did: the steps it released, as (entry id, tenant) in release order,
    and the queues whose window it left full (a step that becomes ready there waits for a slot)."""

    released: list[tuple[str, str]]
    full: frozenset[str]
    published: int = 0
    """Outbox entries put straight onto their broker queue in the same step (a store that is the broker)."""
    queues: frozenset[str] = field(default=frozenset(), compare=False)
    """The queues the pass looked at (``full`` is among them): what a pass in a commit tells the scheduler about."""
    next_due: float | None = field(default=None, compare=False)
    """When the outbox's next entry comes due after the pass (None: the outbox is empty; a claimed
    entry counts at the end of its hold): how long the relay may sleep (``release_and_claim`` only)."""


@dataclass(frozen=True)
class OutboxEntry:
    """A step to publish, due at ``due_at`` (a delayed retry is due later)."""

    step: Step
    due_at: float

    @property
    def id(self) -> str:
        return step_id(self.step)


HSet: TypeAlias = tuple[Literal["hset"], str, dict[str, str]]
HDel: TypeAlias = tuple[Literal["hdel"], str, list[str]]
Del: TypeAlias = tuple[Literal["del"], str]
Set: TypeAlias = tuple[Literal["set"], str, str, int]
"""(op, key, value, ttl_s); ttl_s 0: no expiry."""
Expire: TypeAlias = tuple[Literal["expire"], str, int]
ZAdd: TypeAlias = tuple[Literal["zadd", "zaddnx"], str, str, float]
"""(op, key, member, score); zaddnx keeps the score of a member already there."""
ZRem: TypeAlias = tuple[Literal["zrem"], str, str]
ZTrim: TypeAlias = tuple[Literal["ztrim"], str, float]
"""(op, key, max_score): drop the members scored up to it."""
SAdd: TypeAlias = tuple[Literal["sadd"], str, str]
XAdd: TypeAlias = tuple[Literal["xadd"], str, int, str]
"""(op, key, maxlen, payload)."""
RPush: TypeAlias = tuple[Literal["rpush"], str, str, int]
"""(op, key, value, keep_last)."""
Op: TypeAlias = HSet | HDel | Del | Set | Expire | ZAdd | ZRem | ZTrim | SAdd | XAdd | RPush
"""One write, as the Lua script reads it (a list) and the memory store applies it."""


@dataclass
class Change:
    guards: list[Guard] = field(default_factory=list)
    caps: list[Cap] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    events: list[JobEvent] = field(default_factory=list)
    """The events the ops append (kept for in-process listeners: metrics)."""
    outbox: list[OutboxEntry] = field(default_factory=list)
    scheduled: list[Step] = field(default_factory=list)
    """Steps handed to their queue's scheduler (they reach the outbox when it releases them)."""
    freed: set[str] = field(default_factory=set)
    """Queues where this change frees a place in the scheduler's window (a step ended): the next
    pass may release a waiting step there."""
    passed: ReleasePass | None = None
    """Set by a store that is also the broker once it ran, in the commit itself, the scheduler's pass for
    this change's queues and pushed its due dispatches onto their queues: no relay needs to wake."""
    durable: bool = False
    """Acknowledged only once it is as durable as the store is configured to make it (a submit: the
    202 promises the job survives a crash). Redis: WAIT for replicas when OMNI_REDIS_WAIT_REPLICAS > 0."""

    # --- guards ---
    def expect(self, key: str, name: str, *allowed: str | None) -> Change:
        self.guards.append(Guard(key, name, tuple(allowed)))
        return self

    def cap(self, key: str, below: int, *, since: float | None = None, name: str = "") -> Change:
        self.caps.append(Cap(key, below, since, name))
        return self

    # --- writes ---
    def hset(self, key: str, values: dict[str, str]) -> Change:
        if values:
            self.ops.append(("hset", key, dict(values)))
        return self

    def hdel(self, key: str, names: list[str]) -> Change:
        if names:
            self.ops.append(("hdel", key, list(names)))
        return self

    def delete(self, key: str) -> Change:
        self.ops.append(("del", key))
        return self

    def set(self, key: str, value: str, ttl_s: int) -> Change:
        self.ops.append(("set", key, value, int(ttl_s)))
        return self

    def expire(self, key: str, ttl_s: int) -> Change:
        self.ops.append(("expire", key, int(ttl_s)))
        return self

    def zadd(self, key: str, member: str, score: float) -> Change:
        self.ops.append(("zadd", key, member, float(score)))
        return self

    def zaddnx(self, key: str, member: str, score: float) -> Change:
        """Add ``member`` unless it is there already (its score is kept)."""
        self.ops.append(("zaddnx", key, member, float(score)))
        return self

    def zrem(self, key: str, member: str) -> Change:
        self.ops.append(("zrem", key, member))
        return self

    def ztrim(self, key: str, max_score: float) -> Change:
        """Drop the members scored ``max_score`` or less (a sliding window's old entries)."""
        self.ops.append(("ztrim", key, float(max_score)))
        return self

    def sadd(self, key: str, member: str) -> Change:
        self.ops.append(("sadd", key, member))
        return self

    def event(self, event: JobEvent, *, maxlen: int, ttl_s: int) -> Change:
        stream = keys.job_events(event.job_id)
        self.ops.append(("xadd", stream, int(maxlen), event.model_dump_json(exclude={"id"})))
        self.ops.append(("expire", stream, int(ttl_s)))
        self.events.append(event)
        return self

    def rpush(self, key: str, value: str, keep_last: int) -> Change:
        self.ops.append(("rpush", key, value, int(keep_last)))
        return self

    def dispatch(self, step: Step, due_at: float) -> Change:
        """Publish ``step`` once this change commits (outbox); an entry with the same id is replaced."""
        entry = OutboxEntry(step, due_at)
        self.outbox.append(entry)
        self.ops.append(("hset", keys.OUTBOX_ITEMS, {entry.id: to_json(step)}))
        self.ops.append(("zadd", keys.OUTBOX, entry.id, float(due_at)))
        return self

    def schedule(self, step: Step, *, tenant: str, order: float) -> Change:
        """Hand ``step`` to the scheduler of its queue (omni_jobs.dispatch.scheduling): it goes to the outbox
        when the scheduler releases it, in ``order`` among the tenant's steps, tenants in turn."""
        entry_id = step_id(step)
        self.scheduled.append(step)
        self.ops.append(("hset", keys.OUTBOX_ITEMS, {entry_id: to_json(step)}))
        self.ops.append(("zadd", keys.queue_ready(step.queue, tenant), entry_id, float(order)))
        self.ops.append(("zaddnx", keys.queue_tenants(step.queue), tenant, 0.0))
        self.ops.append(("sadd", keys.SCHEDULED_QUEUES, step.queue))
        return self

    def extend(self, other: Change) -> Change:
        self.guards.extend(other.guards)
        self.caps.extend(other.caps)
        self.ops.extend(other.ops)
        self.events.extend(other.events)
        self.outbox.extend(other.outbox)
        self.scheduled.extend(other.scheduled)
        self.freed |= other.freed
        return self

    def wire(self) -> str:
        """The change as the Lua script reads it."""
        return jsontext.dumps({"g": [[g.key, g.field, list(g.allowed)] for g in self.guards],
                               "c": [[c.key, "-inf" if c.since is None else repr(c.since), c.below] for c in self.caps],
                               "o": [list(op) for op in self.ops]})
