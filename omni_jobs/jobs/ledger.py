"""JobLedger: the only writer of job state. Each method is one transition, committed atomically
with everything it causes.

A transition reads the job (or uses the snapshot its caller already holds), decides with the pure
state machine (omni_jobs.jobs.state), and commits one Change: the job fields it changed, guarded
by the fields its decision read; its events; and what the difference *causes*, derived here in one
place so that no side effect can leave its state change on its own:

- a slot (a stage, the results step, a webhook message) that becomes ``queued`` dispatches its
  next attempt through the outbox, and enters its queue's waiting index;
- a slot that becomes ``running`` holds a lease (owner, expiry) in the lease index; leaving
  ``running`` releases it;
- events that a job's webhook subscribes to create webhook messages, dispatched the same way.

If a guard fails (another process changed what the decision read), the transition reads again and
decides again. Steps are fenced by attempt: a worker may start attempt N only while the slot waits
for exactly N, and may record a result only while it still holds attempt N's lease. So duplicate
messages, stale attempts and late results are refused here, whatever the broker redelivers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from omni_jobs.artifacts.refs import ArtifactRef
from omni_jobs.core import keys
from omni_jobs.core.errors import (
    IdempotencyConflict,
    JobAlreadyFinished,
    JobNotFound,
    NotDurable,
    Overloaded,
    QuotaExceeded,
)
from omni_jobs.core.json_types import JsonObject
from omni_jobs.jobs import codec, state
from omni_jobs.jobs.change import Cap, Change, Conflict, Guard
from omni_jobs.jobs.flows import Commit, CommitPlaced, Flow, Get, Idempotency, Oldest, QueuePosition, adrive, drive
from omni_jobs.jobs.followed import LOOK, LOOKED_AT_TTL_S
from omni_jobs.jobs.models import (
    WEBHOOK_EVENT_OF,
    EventType,
    Job,
    JobError,
    JobEvent,
    JobOutput,
    JobStatus,
    Priority,
    StageRecord,
    StageStatus,
    StepSlot,
    WebhookDelivery,
    new_message_id,
    now,
)
from omni_jobs.jobs.steps import (
    RESULTS_QUEUE,
    WEBHOOKS_QUEUE,
    AssembleResults,
    DeliverWebhook,
    RunStage,
    Step,
    StepKind,
    parse_slot,
    results_slot,
    stage_slot,
    step_id,
    webhook_slot,
)
from omni_jobs.jobs.store import IdempotencyRecord, JobPage, JobStore, webhook_field

log = logging.getLogger(__name__)

T = TypeVar("T")
Listener = Callable[[Job, list[JobEvent]], None]
"""Called in this process after each committed transition (metrics); never part of the transaction."""

MAX_CONFLICTS = 100


@dataclass(frozen=True)
class Lease:
    """The right to run one attempt of one step, held by one worker process (``owner``)."""

    step: Step
    owner: str

    @property
    def slot(self) -> str:
        return self.step.slot

    @property
    def attempt(self) -> int:
        return self.step.attempt

    @property
    def job_id(self) -> str:
        return self.step.job_id


@dataclass(frozen=True)
class Acquired:
    job: Job
    lease: Lease


@dataclass(frozen=True)
class Refused:
    """The step was not started (or its result not recorded): a duplicate, a stale attempt, a job
    that ended. Not an error: the message is acknowledged and dropped."""

    reason: str


@dataclass(frozen=True)
class WrittenOutputs:
    """A job's final files, written already by the worker completing its last stage (results inline),
    and the stage outputs they were made of: they end the job in that stage's own write if the job
    then has those outputs."""

    made_from: list[dict[str, ArtifactRef]]
    outputs: list[JobOutput]


@dataclass(frozen=True)
class Quota:
    """A tenant's limits (0: none): jobs not finished at once, and jobs submitted per minute."""

    max_active: int = 0
    per_minute: int = 0


QUEUE_FULL = "queue_full"
"""The name of a submit's cap on its entry queue's waiting steps (admission)."""


@dataclass(frozen=True)
class QueueLimit:
    """Admission: new jobs are refused (Overloaded) while ``max_waiting`` steps wait on ``queue``.
    Counted in the submit's own write, so a burst cannot slip past it between a read and the write."""

    queue: str
    max_waiting: int
    retry_after_s: int


class RequirementFailed(Exception):
    """A submit's ``requires`` guard did not hold (e.g. its API key was revoked): nothing was written."""

    def __init__(self, guard: Guard, found: str | None) -> None:
        super().__init__(f"{guard.key} {guard.field}: found {found!r}")
        self.guard = guard
        self.found = found


@dataclass(frozen=True)
class Submitted:
    """What a submit answers: the job, whether this call created it (False: an Idempotency-Key
    replay), and its queue position (None when no stage of it waits, or the submit did not ask)."""

    job: Job
    created: bool
    queue_position: int | None


@dataclass(frozen=True)
class _SubmitPlan:
    """What a submit decided: the job as stored and the Change that stores it, and for a refusal,
    when it was decided and what it claimed."""

    job: Job
    change: Change
    at: float
    idempotency: tuple[str, str] | None
    queue_limits: tuple[QueueLimit, ...]


@dataclass
class _Decision(Generic[T]):
    """What a transition decided: the job after it (None: write nothing), its events, its result."""

    value: T
    after: Job | None = None
    events: list[JobEvent] = field(default_factory=list)
    guard: tuple[str, ...] = ()
    """Job fields whose values the decision read (besides ``status``): they must not have changed."""
    extra: Change | None = None


class JobLedger:
    def __init__(self, store: JobStore, *, lease_s: float = 15.0, max_attempts: int = 6,
                 webhook_progress_interval_s: float = 2.0, webhook_attempts: Callable[[str], int] | None = None,
                 deliveries_kept: int = 100, priority_aging_s: float = 300.0) -> None:
        """``max_attempts``: attempts of a stage (or the results step) before its job fails, counting
        those lost with their worker; ``webhook_attempts``: attempts of a webhook message, by event;
        ``priority_aging_s``: how far ahead a high job's stages go, and how far back a low one's."""
        self.store = store
        self.priority_aging_s = priority_aging_s
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self.webhook_progress_interval_s = webhook_progress_interval_s
        self.webhook_attempts = webhook_attempts or (lambda _event: 10)
        self.deliveries_kept = deliveries_kept
        self.listeners: list[Listener] = []
        self.outbox_listeners: list[Callable[[Change], None]] = []
        """Called with a commit that wrote outbox entries, made steps ready or freed a place in a
        queue's window (the relay of this process wakes up)."""

    # --- reading ---
    def get(self, job_id: str) -> Job | None:
        return self.store.get(job_id)

    def require(self, job_id: str, *, tenant: str | None = None) -> Job:
        """The job; JobNotFound when unknown or, with ``tenant``, owned by another tenant (same answer)."""
        job = self.store.get(job_id)
        if job is None or (tenant is not None and job.tenant != tenant):
            raise JobNotFound(job_id)
        return job

    def page(self, *, limit: int, cursor: str | None = None, status: JobStatus | None = None,
             tenant: str | None = None) -> JobPage:
        return self.store.page(limit=limit, cursor=cursor, status=status, tenant=tenant)

    def events(self, job_id: str, *, after: str = "0-0", block_ms: int | None = None,
               count: int = 100) -> list[JobEvent]:
        return self.store.events(job_id, after=after, block_ms=block_ms, count=count)

    def queue_position(self, job: Job) -> int | None:
        return self.store.queue_position(job)

    # --- the machinery: decide, derive, commit, retry on conflict ---
    def _transition(self, job_id: str, decide: Callable[[Job], _Decision[T]], *, missing: Callable[[], T],
                    snapshot: Job | None = None) -> T:
        job = snapshot if snapshot is not None else self.store.get(job_id)
        for _ in range(MAX_CONFLICTS):
            if job is None:
                return missing()
            decision = decide(job)
            if decision.after is None and decision.extra is None:
                return decision.value
            change = self._change(job, decision)
            if self.store.commit(change) is None:
                self._committed(decision.after or job, change)
                return decision.value
            job = self.store.get(job_id)
        raise RuntimeError(f"job {job_id}: more than {MAX_CONFLICTS} conflicting writers; giving up this transition")

    def _change(self, before: Job, decision: _Decision[T], *, new_job: bool = False) -> Change:
        """The Change of a decision: guarded field writes, and everything the difference causes.
        ``new_job``: ``before`` is not stored yet; all of ``after`` is written, once."""
        change = Change()
        after = decision.after or before
        job_key = keys.job(before.id)
        if new_job:
            change.expect(job_key, "id", None).hset(job_key, codec.encode(after)).expire(job_key, self.store.ttl_s)
            change.zadd(keys.JOBS_INDEX, after.id, after.created_at)
            change.zadd(keys.tenant_jobs(after.tenant), after.id, after.created_at)
            for tenant in (None, after.tenant):
                change.zadd(keys.jobs_by_status(after.status.value, tenant), after.id, after.created_at)
            if after.deadline_at is not None:
                change.zadd(keys.DEADLINES, after.id, after.deadline_at)
        else:
            old = codec.encode(before)
            for name in ("status", *decision.guard):
                change.expect(job_key, name, old.get(name))
            sets, dels = codec.diff(old, codec.encode(after))
            change.hset(job_key, sets).hdel(job_key, dels)
        if after.progress != before.progress:
            progress_key = keys.job_progress(before.id)
            if after.progress is None:
                change.delete(progress_key)
            else:
                change.set(progress_key, after.progress.model_dump_json(), self.store.ttl_s)
        for event in decision.events:
            change.event(event, maxlen=self.store.events_maxlen, ttl_s=self.store.ttl_s)
        for was, rec in zip(before.stages, after.stages, strict=True):
            self._slot_effects(change, stage_slot(before.id, rec.id), rec.queue, was, rec,
                               RunStage(before.id, rec.id, rec.attempts + 1, rec.queue),
                               RunStage(before.id, rec.id, was.attempts + 1, rec.queue), job=after)
        self._slot_effects(change, results_slot(before.id), RESULTS_QUEUE, before.results, after.results,
                           AssembleResults(before.id, after.results.attempts + 1),
                           AssembleResults(before.id, before.results.attempts + 1))
        if after.status.is_final and not before.status.is_final:
            change.zrem(keys.tenant_active(after.tenant), after.id).zrem(keys.DEADLINES, after.id)
        if after.status is not before.status and not new_job:
            for tenant in (None, after.tenant):
                change.zrem(keys.jobs_by_status(before.status.value, tenant), after.id)
                change.zadd(keys.jobs_by_status(after.status.value, tenant), after.id, after.created_at)
        self._webhook_messages(after, decision.events, change)
        if decision.extra is not None:
            change.extend(decision.extra)
        return change

    def _slot_effects(self, change: Change, slot: str, queue: str, was: StageRecord | StepSlot,
                      now_: StageRecord | StepSlot, next_step: Step, waited_step: Step, *, job: Job | None = None
                      ) -> None:
        """Dispatch, queue index and lease index entries implied by one slot's before/after.

        A stage's first attempt (``job`` given) goes to its queue's scheduler, which releases it to
        the broker in turn (omni_jobs.dispatch.scheduling); a retry, a requeue and the other steps keep their
        place and are dispatched directly. What is dispatched counts as released until it starts.
        """
        queued, running = StageStatus.queued, StageStatus.running
        if now_.status is queued and (was.status is not queued or was.attempts != now_.attempts
                                      or was.queued_at != now_.queued_at):
            due = now_.queued_at if now_.queued_at is not None else now()
            change.zadd(keys.queue_waiting(queue), slot, due)
            if job is not None and now_.attempts == 0:
                change.schedule(next_step, tenant=job.tenant, order=self.order(job, due))
            else:
                change.dispatch(next_step, due).zadd(keys.queue_released(queue), slot, due)
        if was.status is queued and now_.status is not queued:
            # Started, or ended while waiting: whatever of its dispatch is not out yet need not go out.
            entry = step_id(waited_step)
            change.zrem(keys.queue_waiting(queue), slot).zrem(keys.queue_released(queue), slot)
            change.zrem(keys.OUTBOX, entry).hdel(keys.OUTBOX_ITEMS, [entry])
            if job is not None:
                change.zrem(keys.queue_ready(queue, job.tenant), entry)
            if now_.status is not running:  # ended while released: its place is free
                change.freed.add(queue)
        if now_.status is running:
            if was.status is not running:
                change.zadd(keys.queue_running(queue), slot, now())
            if now_.lease_until is not None and now_.lease_until != was.lease_until:
                change.zadd(keys.LEASES, slot, now_.lease_until)
        if was.status is running and now_.status is not running:
            change.zrem(keys.queue_running(queue), slot).zrem(keys.LEASES, slot)
            change.freed.add(queue)

    def order(self, job: Job, queued_at: float) -> float:
        """A waiting stage's place among its tenant's: its queued time, moved ahead (high) or back
        (low) by ``priority_aging_s``. So a high job overtakes normal work queued up to that long
        before it, and a low one is overtaken at most by normal work queued up to that long after it."""
        shift = {Priority.high: -1.0, Priority.normal: 0.0, Priority.low: 1.0}[job.priority]
        return queued_at + shift * self.priority_aging_s

    def _webhook_messages(self, job: Job, events: list[JobEvent], change: Change) -> None:
        """One message per subscribed webhook event among ``events`` (progress throttled per job)."""
        hook = job.webhook
        if hook is None or not events:
            return
        chosen: list[str] = []
        for event in events:
            name = WEBHOOK_EVENT_OF.get(event.type) if isinstance(event.type, EventType) else None
            if name is None or name not in hook.events or name in chosen:
                continue
            if event.type is EventType.stage_progress and not self.store.throttle(
                    f"webhook-progress:{job.id}", self.webhook_progress_interval_s):
                continue
            if event.type is EventType.output_preview and not self.store.throttle(
                    f"webhook-preview:{job.id}", self.webhook_progress_interval_s):
                continue
            chosen.append(name)
        hooks_key = keys.job_webhooks(job.id)
        at = now()
        for name in chosen:
            mid = new_message_id()
            change.hset(hooks_key, {webhook_field(mid, "event"): name, webhook_field(mid, "status"): "queued",
                                    webhook_field(mid, "attempts"): "0"}).expire(hooks_key, self.store.ttl_s)
            change.zadd(keys.queue_waiting(WEBHOOKS_QUEUE), webhook_slot(job.id, mid), at)
            change.zadd(keys.queue_released(WEBHOOKS_QUEUE), webhook_slot(job.id, mid), at)
            change.dispatch(DeliverWebhook(job.id, mid, name, 1), at)

    def _committed(self, job: Job, change: Change) -> None:
        if change.events:
            for listener in self.listeners:
                try:
                    listener(job, change.events)
                except Exception:
                    log.exception("job %s: listener %r failed", job.id, listener)
        if change.outbox or change.scheduled or change.freed:
            for wake in self.outbox_listeners:
                wake(change)

    def _commit_or_none(self, change: Change, job: Job | None = None) -> bool:
        if self.store.commit(change) is not None:
            return False
        if job is not None:
            self._committed(job, change)
        elif change.outbox or change.scheduled or change.freed:
            for wake in self.outbox_listeners:
                wake(change)
        return True

    # --- submit ---
    def submit(self, job: Job, entry_stages: list[str], *, idempotency: tuple[str, str] | None = None,
               idempotency_ttl_s: int = 24 * 3600, quota: Quota | None = None,
               queue_limits: Sequence[QueueLimit] = (), requires: Sequence[Guard] = ()) -> tuple[Job, bool]:
        """Store a new job, its idempotency record and its first dispatches in one write (``submit_flow``,
        on this thread): (the job, whether this call created it)."""
        done = drive(self.store, self.submit_flow(job, entry_stages, idempotency=idempotency,
                                                  idempotency_ttl_s=idempotency_ttl_s, quota=quota,
                                                  queue_limits=queue_limits, requires=requires))
        return done.job, done.created

    async def asubmit(self, job: Job, entry_stages: list[str], *, idempotency: tuple[str, str] | None = None,
                      idempotency_ttl_s: int = 24 * 3600, quota: Quota | None = None,
                      queue_limits: Sequence[QueueLimit] = (), requires: Sequence[Guard] = ()) -> Submitted:
        """``submit`` on an event loop (the API): the same flow, committed with the store's async client
        in one round trip that also reads the job's queue position."""
        return await adrive(self.store, self.submit_flow(job, entry_stages, idempotency=idempotency,
                                                         idempotency_ttl_s=idempotency_ttl_s, quota=quota,
                                                         queue_limits=queue_limits, requires=requires, placed=True))

    def submit_flow(self, job: Job, entry_stages: list[str], *, idempotency: tuple[str, str] | None,
                    idempotency_ttl_s: int, quota: Quota | None, queue_limits: Sequence[QueueLimit],
                    requires: Sequence[Guard], placed: bool = False) -> Flow[Submitted]:
        """A submit, for either driver (omni_jobs.jobs.flows): one write of the job, its idempotency
        record and its first dispatches.

        ``idempotency``: (key, request fingerprint). A key used before answers (that job, created False),
        or IdempotencyConflict when the body differed. The write's guards go before its caps, so a replay
        is found (and answered) even where a new job would be refused, with no read before the write.
        ``quota``: the tenant's limits, and ``queue_limits``: how many steps may wait on each entry
        queue, both checked in the same write (QuotaExceeded, Overloaded: nothing is written).
        ``requires``: fields that must hold for the write to apply (the API's: the submitting key is not
        revoked); RequirementFailed when one does not, and nothing is written. ``placed``: the answer
        carries the job's queue position, read in the write's own round trip (else None).
        """
        plan = self._plan_submit(job, entry_stages, idempotency, idempotency_ttl_s, quota, queue_limits)
        plan.change.guards[:0] = requires
        try:
            if placed:
                conflict, position = yield from CommitPlaced(plan.change, plan.job)
            else:
                conflict, position = (yield from Commit(plan.change)), None
        except NotDurable as exc:  # applied, but not yet on the disk or a replica: name the job it made
            self._committed(plan.job, plan.change)
            raise exc.of_job(plan.job.id) from None
        if conflict is None:
            self._committed(plan.job, plan.change)
            return Submitted(plan.job, True, position)
        if self._made_by_this_write(plan, conflict):
            self._committed(plan.job, plan.change)
            return Submitted(plan.job, True, (yield from QueuePosition(plan.job)) if placed else None)
        if conflict.cap is not None:
            since = conflict.cap.since
            oldest = (yield from Oldest(conflict.cap.key, since)) if since is not None else None
            raise self._submit_refused(plan, conflict.cap, conflict.found, oldest)
        if conflict.guard is not None and conflict.guard in requires:
            raise RequirementFailed(conflict.guard, conflict.found)
        claim = self._replay_claim(plan, conflict)
        earlier = yield from Idempotency(job.tenant, claim[0])
        if earlier is None:  # expired between the write and the read: try again
            return (yield from self.submit_flow(job, entry_stages, idempotency=idempotency,
                                                idempotency_ttl_s=idempotency_ttl_s, quota=quota,
                                                queue_limits=queue_limits, requires=requires, placed=placed))
        existing = yield from Get(self._replayed(claim, earlier))
        if existing is None:
            raise IdempotencyConflict(claim[0], earlier.job_id)
        return (yield from self.replayed(existing, placed=placed))

    @staticmethod
    def replayed(job: Job, *, placed: bool) -> Flow[Submitted]:
        """An earlier job answered again (an Idempotency-Key replay), with its queue position now where
        ``placed``."""
        return Submitted(job, False, (yield from QueuePosition(job)) if placed else None)

    def submit_all(self, jobs: Sequence[tuple[Job, list[str], tuple[str, str] | None]], *,
                   idempotency_ttl_s: int = 24 * 3600, quota: Quota | None = None,
                   queue_limits: Sequence[QueueLimit] = ()) -> list[tuple[Job, bool]]:
        """Store several new jobs (job, entry stages, Idempotency claim) in ONE write: all of them or
        none. A quota or a full queue refuses the whole write (nothing is written, nothing is charged);
        its caps are lowered by ``len(jobs) - 1``, so the write applies only where every job fits (an
        OpenAI images call with n > 1 used to run the first k-1 images and answer 429 for the k-th).

        Claims used before are answered as ``submit`` answers them: their earlier jobs (created False),
        and the jobs of the other claims are stored in one write again."""
        if not jobs:
            return []
        plans = [self._plan_submit(job, entry, claim, idempotency_ttl_s, quota, queue_limits)
                 for job, entry, claim in jobs]
        change = _all_of([plan.change for plan in plans])
        try:
            conflict = self.store.commit(change)
        except NotDurable as exc:  # applied, but not yet on the disk or a replica: name the jobs it made
            for plan in plans:
                self._committed(plan.job, plan.change)
            raise exc.of_job(plans[0].job.id) from None
        made = conflict is not None and any(self._made_by_this_write(plan, conflict) for plan in plans)
        if conflict is None or made:
            for plan in plans:
                self._committed(plan.job, plan.change)
            return [(plan.job, True) for plan in plans]
        if conflict.cap is not None:
            since = conflict.cap.since
            oldest = self.store.oldest(conflict.cap.key, since=since) if since is not None else None
            raise self._submit_refused(plans[0], conflict.cap, conflict.found, oldest)
        return self._replay_some(jobs, idempotency_ttl_s=idempotency_ttl_s, quota=quota, queue_limits=queue_limits)

    def _replay_some(self, jobs: Sequence[tuple[Job, list[str], tuple[str, str] | None]], *, idempotency_ttl_s: int,
                     quota: Quota | None, queue_limits: Sequence[QueueLimit]) -> list[tuple[Job, bool]]:
        """``submit_all`` after a claim's guard refused it: the claims used before answer their earlier jobs
        (IdempotencyConflict for another body), the others are submitted together again."""
        earlier: dict[int, Job] = {}
        for i, (job, _entry, claim) in enumerate(jobs):
            record = self.store.idempotency(job.tenant, claim[0]) if claim is not None else None
            if claim is None or record is None:
                continue
            existing = self.store.get(self._replayed(claim, record))
            if existing is None:
                raise IdempotencyConflict(claim[0], record.job_id)
            earlier[i] = existing
        if not earlier:
            raise RuntimeError(f"job ids {[job.id for job, _e, _c in jobs]} conflict, and no claim was used before")
        rest = [entry for i, entry in enumerate(jobs) if i not in earlier]
        made = iter(self.submit_all(rest, idempotency_ttl_s=idempotency_ttl_s, quota=quota, queue_limits=queue_limits))
        return [(earlier[i], False) if i in earlier else next(made) for i in range(len(jobs))]

    def _plan_submit(self, job: Job, entry_stages: list[str], idempotency: tuple[str, str] | None,
                     idempotency_ttl_s: int, quota: Quota | None, queue_limits: Sequence[QueueLimit]) -> _SubmitPlan:
        """The one decision of a submit (``submit_flow``, ``submit_all``): the job as stored, and its Change."""
        at = job.created_at
        # Queuing the entry stages changes only their records: copy those, share the rest (a deep
        # copy of the whole job was a few per cent of a submit's CPU).
        after = job.model_copy(update={"stages": [r.model_copy() for r in job.stages]})
        events = [JobEvent(job_id=job.id, type=EventType.job_queued, at=at, data={"pipeline": job.pipeline})]
        for stage_id in entry_stages:
            events += state.stage_queued(after, stage_id, at)
        change = self._change(job, _Decision(None, after, events), new_job=True)
        if idempotency is not None:
            record_key = keys.idempotency(job.tenant, idempotency[0])
            change.expect(record_key, "job_id", None)
            change.hset(record_key, {"job_id": job.id, "fingerprint": idempotency[1]})
            change.expire(record_key, idempotency_ttl_s)
        submitted_at = now()
        for limit in queue_limits:  # first: a full queue answers 503 before a quota answers 429, as it did
            change.cap(keys.queue_waiting(limit.queue), limit.max_waiting, name=QUEUE_FULL)
        active, submits = keys.tenant_active(job.tenant), keys.tenant_submits(job.tenant)
        if quota is not None and quota.max_active:
            change.cap(active, quota.max_active, name="max_active")
        if quota is not None and quota.per_minute:
            change.cap(submits, quota.per_minute, since=submitted_at - 60, name="jobs_per_minute")
        change.zadd(active, job.id, job.created_at).zadd(submits, job.id, submitted_at)
        change.ztrim(submits, submitted_at - 60).expire(submits, 120)
        change.durable = True
        return _SubmitPlan(after, change, submitted_at, idempotency, tuple(queue_limits))

    def _submit_refused(self, plan: _SubmitPlan, cap: Cap, found: str | None,
                        oldest: float | None) -> QuotaExceeded | Overloaded:
        """The refusal of a submit that reached ``cap`` (``oldest``: the rate window's first entry)."""
        if cap.name == QUEUE_FULL:
            limit = next(q for q in plan.queue_limits if keys.queue_waiting(q.queue) == cap.key)
            return Overloaded(limit.queue, int(found or cap.below), limit.max_waiting, limit.retry_after_s)
        if cap.since is not None:  # a rate: the oldest submission in the window leaves it first
            retry_after = max(1.0, (oldest or plan.at) + 60 - plan.at)
        else:
            retry_after = 5.0
        return QuotaExceeded(plan.job.tenant, cap.name, cap.below, retry_after)

    @staticmethod
    def _made_by_this_write(plan: _SubmitPlan, conflict: Conflict) -> bool:
        """Whether the submit's own job-id guard refused it: the job exists, and its id is this write's
        own (random, made for it), so this very write applied before, and its reply was lost. The client
        sent the same script again (redis-py retries a command whose connection dropped), and the job it
        made is the answer: it was a 500 while the job ran. The job's guard is the first of a submit's
        own, so this is found before the Idempotency-Key's guard (which would refuse it as a replay of
        itself)."""
        guard = conflict.guard
        made = guard is not None and guard.key == keys.job(plan.job.id) and guard.field == "id"
        if made:
            log.info("job %s: the submit's reply was lost and it was sent again; answering the job it made",
                     plan.job.id)
        return made

    @staticmethod
    def _replay_claim(plan: _SubmitPlan, conflict: Conflict) -> tuple[str, str]:
        """The idempotency claim that conflicted (a key used before); any other conflict is a bug."""
        if plan.idempotency is None or conflict.guard is None or conflict.guard.field != "job_id":
            raise RuntimeError(f"job id {plan.job.id} already exists")
        return plan.idempotency

    @staticmethod
    def _replayed(claim: tuple[str, str], earlier: IdempotencyRecord) -> str:
        """The earlier job's id when the body is the same; IdempotencyConflict when it is not."""
        if earlier.fingerprint != claim[1]:
            raise IdempotencyConflict(claim[0], earlier.job_id)
        return earlier.job_id

    # --- taking a step ---
    def acquire(self, step: Step, *, worker: str, owner: str, snapshot: Job | None = None) -> Acquired | Refused:
        """Start ``step`` in this worker: its slot must be waiting for exactly this attempt."""
        if isinstance(step, DeliverWebhook):
            return self._acquire_webhook(step, worker=worker, owner=owner)
        lease = Lease(step, owner)

        def decide(job: Job) -> _Decision[Acquired | Refused]:
            if job.status.is_final:
                return _Decision(Refused(f"job is {job.status.value}"))
            at = now()
            slot: StageRecord | StepSlot = (job.stage_record(step.stage_id) if isinstance(step, RunStage)
                                             else job.results)
            if slot.status is StageStatus.running and slot.attempts == step.attempt and slot.lease_owner == owner:
                return _Decision(Acquired(job, lease))  # this worker took it already (a retried write)
            if slot.status is not StageStatus.queued or slot.attempts != step.attempt - 1:
                return _Decision(Refused(_why_not(slot, step.attempt)))
            after = job.clone()
            if job.deadline_at is not None and at > job.deadline_at:
                events = state.job_canceled(after, at, reason="deadline exceeded (cancel_after)")
                return _Decision(Refused("the job passed its deadline (cancel_after): canceled"), after, events)
            if isinstance(step, RunStage):
                events = state.stage_started(after, step.stage_id, worker, at)
                held: StageRecord | StepSlot = after.stage_record(step.stage_id)
                guard: tuple[str, ...] = (f"stage:{step.stage_id}:status", f"stage:{step.stage_id}:attempts")
                for rec in _runnable(after):  # a stage that reads this one's output while it is written starts too
                    events += state.stage_queued(after, rec.id, at)
                    guard += (f"stage:{rec.id}:status", f"stage:{rec.id}:attempts")
            else:
                if job.status is not JobStatus.running:
                    return _Decision(Refused(f"job is {job.status.value}"))
                events = []
                state.results_started(after, worker)
                held = after.results
                guard = ("results:status", "results:attempts")
            held.lease_owner = owner
            held.lease_until = at + self.lease_s
            return _Decision(Acquired(after, lease), after, events, guard)

        return self._transition(step.job_id, decide, missing=lambda: Refused("job is gone (expired or deleted)"),
                                snapshot=snapshot)

    def _acquire_webhook(self, step: DeliverWebhook, *, worker: str, owner: str) -> Acquired | Refused:
        job = self.store.get(step.job_id)
        slot = self.store.webhook_slots(step.job_id).get(step.message_id)
        if job is None or slot is None:
            return Refused("job or webhook message is gone")
        lease = Lease(step, owner)
        if slot.status == "sending" and slot.attempts == step.attempt and slot.lease_owner == owner:
            return Acquired(job, lease)
        if slot.status != "queued" or slot.attempts != step.attempt - 1:
            return Refused(f"webhook {step.message_id} is {slot.status} at attempt {slot.attempts}, "
                           f"not waiting for attempt {step.attempt}")
        hooks, name = keys.job_webhooks(step.job_id), step.message_id
        until = now() + self.lease_s
        change = (Change().expect(hooks, webhook_field(name, "status"), "queued")
                  .expect(hooks, webhook_field(name, "attempts"), str(step.attempt - 1))
                  .hset(hooks, {webhook_field(name, "status"): "sending", webhook_field(name, "attempts"): str(step.attempt),
                                webhook_field(name, "worker"): worker, webhook_field(name, "lease_owner"): owner,
                                webhook_field(name, "lease_until"): repr(until)})
                  .zrem(keys.queue_waiting(WEBHOOKS_QUEUE), step.slot)
                  .zrem(keys.queue_released(WEBHOOKS_QUEUE), step.slot)
                  .zadd(keys.queue_running(WEBHOOKS_QUEUE), step.slot, now())
                  .zadd(keys.LEASES, step.slot, until))
        if not self._commit_or_none(change):
            return self._acquire_webhook(step, worker=worker, owner=owner)
        return Acquired(job, lease)

    def renew(self, leases: list[Lease]) -> list[Lease]:
        """Extend each lease; returns those this process no longer holds (job ended, or reaped)."""
        changes: list[Change] = []
        for lease in leases:
            until = now() + self.lease_s
            change = _while_held(lease)
            if isinstance(lease.step, DeliverWebhook):
                hooks, name = keys.job_webhooks(lease.job_id), lease.step.message_id
                change.hset(hooks, {webhook_field(name, "lease_until"): repr(until)})
            else:
                change.hset(keys.job(lease.job_id), {_slot_prefix(lease.step) + "lease_until": repr(until)})
            change.zadd(keys.LEASES, lease.slot, until)
            changes.append(change)
        conflicts = self.store.commit_each(changes)  # one round trip for all of them
        return [lease for lease, conflict in zip(leases, conflicts, strict=True) if conflict is not None]

    # --- while a stage runs ---
    def progress(self, lease: Lease, snapshot: Job, step: int, total: int, unit: str) -> str:
        """Record a running stage's progress: 'ok', or 'canceled' / 'lost' (stop working on it)."""
        return self.progress_many([(lease, snapshot, step, total, unit)])[0]

    def progress_many(self, reports: Sequence[tuple[Lease, Job, int, int, str]]) -> list[str]:
        """``progress`` of several running stages (lease, snapshot, step, total, unit), in one round
        trip: a batched engine reports for every member at once."""
        at = now()
        writes: list[tuple[Lease, Job, JobEvent]] = []
        for lease, snapshot, step, total, unit in reports:
            assert isinstance(lease.step, RunStage)
            after = snapshot.model_copy()  # shallow: only its progress changes
            (event,) = state.stage_progress(after, lease.step.stage_id, step, total, unit, at)
            writes.append((lease, after, event))
        return self._while_running(writes)

    def publish(self, lease: Lease, snapshot: Job, event_type: EventType, data: JsonObject) -> str:
        """Append a running stage's partial output (a text delta, a preview) to its job's event stream,
        while the lease still holds: 'ok', or 'canceled' / 'lost' (stop working on it).

        It changes no job field, so it never conflicts with progress; the guard only keeps an attempt
        that lost its lease (or a canceled job) from adding to the stream."""
        return self.publish_many([(lease, snapshot, event_type, data)])[0]

    def publish_many(self, items: Sequence[tuple[Lease, Job, EventType, JsonObject]]) -> list[str]:
        """``publish`` of several running stages' partial outputs (lease, snapshot, type, data), in one
        round trip: a batched engine's step yields a delta for each of its requests at once."""
        at = now()
        return self._while_running([(lease, snapshot, JobEvent(job_id=lease.job_id, type=event_type, at=at, data=data))
                                    for lease, snapshot, event_type, data in items])

    def _while_running(self, writes: Sequence[tuple[Lease, Job, JobEvent]]) -> list[str]:
        """Write what running stages report (lease, the job with its progress, event), each guarded
        by its own lease, in one round trip: per write 'ok', 'canceled' or 'lost'.

        A report changes no field of the job (its progress has a key of its own), so its write is
        built from the lease, as a renewal is: the job is not encoded, which was most of its cost."""
        changes: list[Change] = []
        for lease, job, event in writes:
            change = _while_held(lease)
            if event.type is EventType.stage_progress and job.progress is not None:
                change.set(keys.job_progress(lease.job_id), job.progress.model_dump_json(), self.store.ttl_s)
            change.event(event, maxlen=self.store.events_maxlen, ttl_s=self.store.ttl_s)
            self._webhook_messages(job, [event], change)
            changes.append(change)
        outcomes: list[str] = []
        for (lease, job, _event), change, conflict in zip(writes, changes, self.store.commit_each(changes), strict=True):
            if conflict is None:
                self._committed(job, change)
                outcomes.append("ok")
                continue
            current = self.store.get(lease.job_id)
            outcomes.append("canceled" if current is None or current.status is JobStatus.canceled else "lost")
        return outcomes

    # --- a step ends ---
    def complete_stage(self, lease: Lease, outputs: dict[str, ArtifactRef], metrics: dict[str, float], *,
                       snapshot: Job | None = None, results_worker: str | None = None,
                       first: Sequence[JobEvent] = (), written: WrittenOutputs | None = None) -> Job | Refused:
        """Record the stage's outputs and queue what became runnable (next stages, or the results step).

        ``first``: events of the attempt that go out with its result, before its own (the last
        delta of a streamed text): nothing of them is written if the result is refused.

        ``results_worker``: when this was the job's last stage, that worker takes the results step in
        the same write, under this attempt's lease owner (results inline: no hop through the results
        queue). If it dies before the results are written, the results lease expires and the reaper
        requeues the step to the results queue like any lost attempt.

        ``written``: with ``results_worker``, the final files are written already: if they were made
        of the outputs the job now has, this same write takes the results step and ends the job
        succeeded (one write where there were two); else the results step is taken as above."""
        step = lease.step
        assert isinstance(step, RunStage)

        def decide(job: Job) -> _Decision[Job | Refused]:
            record = job.stage_record(step.stage_id)
            if record.status is StageStatus.succeeded and record.attempts == step.attempt:
                return _Decision(job)  # recorded already (a retried write)
            if not _holds(job, record, lease):
                return _Decision(Refused(f"stale attempt {step.attempt}: {_why_not(record, step.attempt)}"))
            at = now()
            after = job.clone()
            events = [*first, *state.stage_succeeded(after, step.stage_id, outputs, metrics, at)]
            done = {r.id for r in after.stages if r.status is StageStatus.succeeded}
            for rec in _runnable(after):
                events += state.stage_queued(after, rec.id, at)
            guard = tuple(f"stage:{r.id}:{f}" for r in job.stages for f in ("status", "attempts")) + (
                f"stage:{step.stage_id}:lease_owner",)
            if done == {r.id for r in after.stages}:
                state.results_queued(after, at)
                if results_worker is not None:
                    state.results_started(after, results_worker)
                    guard += ("results:status", "results:attempts")
                    if written is not None and written.made_from == [r.outputs for r in after.stages]:
                        after.outputs = list(written.outputs)
                        events += state.job_succeeded(after, at)
                    else:
                        after.results.lease_owner, after.results.lease_until = lease.owner, at + self.lease_s
            return _Decision(after, after, events, guard)

        return self._transition(step.job_id, decide, missing=lambda: Refused("job is gone"), snapshot=snapshot)

    def complete_results(self, lease: Lease, outputs: list[JobOutput], *, snapshot: Job | None = None) -> Job | Refused:
        """The job's final files are written: it ends succeeded. ``snapshot``: the job as the results
        step took it, decided on without a read (the write's guards refuse it if it is stale, and
        the decision is made again on the stored job)."""

        def decide(job: Job) -> _Decision[Job | Refused]:
            if job.status is JobStatus.succeeded and job.results.attempts == lease.attempt:
                return _Decision(job)
            if not _holds(job, job.results, lease):
                return _Decision(Refused(f"stale results attempt {lease.attempt}"))
            after = job.clone()
            after.outputs = list(outputs)
            events = state.job_succeeded(after, now())
            return _Decision(after, after, events, ("results:status", "results:attempts", "results:lease_owner"))

        return self._transition(lease.job_id, decide, missing=lambda: Refused("job is gone"), snapshot=snapshot)

    def retry_later(self, lease: Lease, error: JobError, delay_s: float) -> str:
        """The attempt hit a transient error: queue the next one after ``delay_s``, or fail the job
        once ``max_attempts`` are used. Returns 'retrying', 'failed' or 'stale'."""

        def decide(job: Job) -> _Decision[str]:
            slot = _slot_of(job, lease.step)
            if not _holds(job, slot, lease):
                return _Decision("stale")
            at = now()
            after = job.clone()
            if slot.attempts >= self.max_attempts:
                return _Decision("failed", after, state.job_failed(after, error, at))
            if isinstance(lease.step, RunStage):
                events = state.stage_requeued(after, lease.step.stage_id, at, reason=f"{error.type}: {error.message}",
                                              retry_at=at + delay_s, lost=False)
            else:
                events = []
                state.results_requeued(after, at + delay_s)
            return _Decision("retrying", after, events, _slot_guard(lease.step))

        return self._transition(lease.job_id, decide, missing=lambda: "stale")

    def fail(self, job_id: str, error: JobError, *, lease: Lease | None = None) -> bool:
        """End the job failed with the stage and reason recorded. With ``lease``, only while that
        attempt is still the current one (a stale attempt's failure is discarded)."""

        def decide(job: Job) -> _Decision[bool]:
            if job.status.is_final:
                return _Decision(False)
            if lease is not None and not _holds(job, _slot_of(job, lease.step), lease):
                return _Decision(False)
            after = job.clone()
            guard = _slot_guard(lease.step) if lease is not None else ()
            return _Decision(True, after, state.job_failed(after, error, now()), guard)

        return self._transition(job_id, decide, missing=lambda: False)

    def cancel(self, job_id: str, reason: str = "canceled by request") -> Job:
        """End the job canceled. The same write marks it looked at, so that a worker running it
        writes its progress at once, finds it canceled and stops (omni_jobs.jobs.followed)."""

        def decide(job: Job) -> _Decision[Job]:
            if job.status.is_final:
                raise JobAlreadyFinished(job.id, job.status.value)
            after = job.clone()
            looked_at = Change().set(keys.job_followed(job.id), LOOK.decode(), LOOKED_AT_TTL_S)
            return _Decision(after, after, state.job_canceled(after, now(), reason), extra=looked_at)

        return self._transition(job_id, decide, missing=lambda: _raise(JobNotFound(job_id)))

    def finish_webhook(self, lease: Lease, delivery: WebhookDelivery, *, retry_at: float | None,
                       final_status: str = "delivered") -> bool:
        """Record one delivery attempt; queue the next attempt at ``retry_at``, or end the message
        with ``final_status`` (delivered | gave_up | rejected). False if the lease was lost."""
        step = lease.step
        assert isinstance(step, DeliverWebhook)
        hooks, name = keys.job_webhooks(step.job_id), step.message_id
        status = "queued" if retry_at is not None else final_status
        change = (Change().expect(hooks, webhook_field(name, "status"), "sending")
                  .expect(hooks, webhook_field(name, "attempts"), str(step.attempt))
                  .expect(hooks, webhook_field(name, "lease_owner"), lease.owner)
                  .hset(hooks, {webhook_field(name, "status"): status})
                  .hdel(hooks, [webhook_field(name, "lease_owner"), webhook_field(name, "lease_until")])
                  .zrem(keys.queue_running(WEBHOOKS_QUEUE), step.slot).zrem(keys.LEASES, step.slot)
                  .rpush(keys.job_deliveries(step.job_id), delivery.model_dump_json(), self.deliveries_kept)
                  .expire(keys.job_deliveries(step.job_id), self.store.ttl_s))
        if retry_at is not None:
            change.zadd(keys.queue_waiting(WEBHOOKS_QUEUE), step.slot, retry_at)
            change.zadd(keys.queue_released(WEBHOOKS_QUEUE), step.slot, retry_at)
            change.dispatch(DeliverWebhook(step.job_id, name, step.event, step.attempt + 1), retry_at)
        return self._commit_or_none(change)

    # --- recovery (the reaper) ---
    def expire(self, slot_name: str, *, dead_owner: Callable[[str | None], bool] | None = None) -> str:
        """Take back a slot whose lease expired (or, with ``dead_owner``, whose owner is known dead):
        its next attempt is queued now, or the job fails after ``max_attempts``. Returns what was done."""
        slot = parse_slot(slot_name)
        if slot.kind is StepKind.deliver_webhook:
            assert slot.name is not None
            return self._expire_webhook(slot.job_id, slot.name, slot_name, dead_owner)

        def decide(job: Job) -> _Decision[str]:
            record: StageRecord | StepSlot = job.stage_record(slot.name) if slot.name else job.results
            at = now()
            dead = dead_owner(record.lease_owner) if dead_owner else (
                record.lease_until is not None and record.lease_until <= at)
            if job.status.is_final or record.status is not StageStatus.running:
                cleanup = Change().zrem(keys.LEASES, slot_name)  # a stale index entry
                return _Decision("cleaned", extra=cleanup)
            if not dead:
                return _Decision("alive")
            after = job.clone()
            who = record.worker or "its worker"
            reason = (f"lease expired: {who} stopped renewing it (killed, or cut off from Redis)" if not dead_owner
                      else f"{who} restarted without finishing it")
            prefix = f"stage:{slot.name}:" if slot.name else "results:"
            guard = (prefix + "status", prefix + "attempts", prefix + "lease_until", prefix + "lease_owner")
            if record.attempts >= self.max_attempts:
                error = JobError(stage=slot.name or "results", type="WorkerLost",
                                 message=f"attempt {record.attempts} of {slot.name or 'the results step'} was lost: "
                                 f"{reason}; gave up after {record.attempts} attempts (a stage that kills its "
                                 "worker every time, e.g. out of memory, ends here)")
                return _Decision("failed", after, state.job_failed(after, error, at), guard)
            if slot.name:
                events = state.stage_requeued(after, slot.name, at, reason=reason, retry_at=at, lost=True)
            else:
                events = []
                state.results_requeued(after, at)
            log.warning("job %s: %s attempt %d lost (%s); queued attempt %d", job.id, slot.name or "results",
                        record.attempts, reason, record.attempts + 1)
            return _Decision("requeued", after, events, guard)

        return self._transition(slot.job_id, decide, missing=lambda: self._drop_lease(slot_name))

    def _expire_webhook(self, job_id: str, message_id: str, slot_name: str,
                        dead_owner: Callable[[str | None], bool] | None) -> str:
        slot = self.store.webhook_slots(job_id).get(message_id)
        if slot is None or slot.status != "sending":
            return self._drop_lease(slot_name)
        at = now()
        dead = dead_owner(slot.lease_owner) if dead_owner else (slot.lease_until or 0) <= at
        if not dead:
            return "alive"
        hooks = keys.job_webhooks(job_id)
        change = (Change().expect(hooks, webhook_field(message_id, "status"), "sending")
                  .expect(hooks, webhook_field(message_id, "attempts"), str(slot.attempts))
                  .expect(hooks, webhook_field(message_id, "lease_owner"), slot.lease_owner)
                  .hdel(hooks, [webhook_field(message_id, "lease_owner"), webhook_field(message_id, "lease_until")])
                  .zrem(keys.queue_running(WEBHOOKS_QUEUE), slot_name).zrem(keys.LEASES, slot_name))
        if slot.attempts >= self.webhook_attempts(slot.event):
            change.hset(hooks, {webhook_field(message_id, "status"): "gave_up"})
            outcome = "gave_up"
        else:
            change.hset(hooks, {webhook_field(message_id, "status"): "queued"})
            change.zadd(keys.queue_waiting(WEBHOOKS_QUEUE), slot_name, at)
            change.zadd(keys.queue_released(WEBHOOKS_QUEUE), slot_name, at)
            change.dispatch(DeliverWebhook(job_id, message_id, slot.event, slot.attempts + 1), at)
            outcome = "requeued"
        return outcome if self._commit_or_none(change) else "conflict"

    def _drop_lease(self, slot_name: str) -> str:
        self.store.commit(Change().zrem(keys.LEASES, slot_name))
        return "cleaned"

    def redispatch(self, slot_name: str, queue: str | None = None) -> bool:
        """Publish a waiting slot's next attempt again (its message was lost by the broker, or held
        by a worker that died before starting it). A duplicate is harmless: only one can start it.
        ``queue``: the queue whose released steps the slot was found among; a slot that waits for
        nothing there (its job is gone, or ended, or the step is no longer queued) leaves them, so
        that no leftover holds a place in the queue's window for ever."""
        slot = parse_slot(slot_name)
        step: Step
        if slot.kind is StepKind.deliver_webhook:
            assert slot.name is not None
            hook = self.store.webhook_slots(slot.job_id).get(slot.name)
            if hook is None or hook.status != "queued":
                return self._forget_released(queue, slot_name)
            step = DeliverWebhook(slot.job_id, slot.name, hook.event, hook.attempts + 1)
        else:
            job = self.store.get(slot.job_id)
            if job is None or job.status.is_final:
                return self._forget_released(queue, slot_name)
            record: StageRecord | StepSlot = job.stage_record(slot.name) if slot.name else job.results
            if record.status is not StageStatus.queued:
                return self._forget_released(queue, slot_name)
            step = (RunStage(job.id, slot.name, record.attempts + 1, job.stage_record(slot.name).queue)
                    if slot.name else AssembleResults(job.id, record.attempts + 1))
        if self.store.outbox_holds([step_id(step)]):
            return False  # not published yet: nothing was lost
        return self._commit_or_none(Change().dispatch(step, now()))

    def _forget_released(self, queue: str | None, slot_name: str) -> bool:
        """Take a slot that waits for nothing off ``queue``'s released steps (a retention delete that
        missed it, an expired job): its place frees, and a pass releases the next step. False: nothing
        was dispatched."""
        if queue is not None:
            change = Change().zrem(keys.queue_released(queue), slot_name)
            change.freed.add(queue)
            if self._commit_or_none(change):
                log.info("%s: released on queue '%s' but waits for nothing there; its place is freed",
                         slot_name, queue)
        return False


def _all_of(changes: Sequence[Change]) -> Change:
    """One write of several submits' changes: their guards and writes, and their caps once, each lowered
    by ``len(changes) - 1`` (at most ``below - 1`` members before the write leaves room for all of them).
    A cap that then leaves no room refuses the write, as a full quota does."""
    merged = Change(durable=True)
    for change in changes:
        merged.extend(change)
    extra = len(changes) - 1
    merged.caps = [Cap(cap.key, cap.below - extra, cap.since, cap.name) for cap in changes[0].caps]
    return merged


def _runnable(job: Job) -> list[StageRecord]:
    """Pending stages whose inputs are ready: every stage they need succeeded, but the one whose output they read
    while it is written (``streams``), which need only have started."""
    status = {r.id: r.status for r in job.stages}
    return [rec for rec in job.stages if rec.status is StageStatus.pending
            and all(status[n] is StageStatus.succeeded
                    or (n in rec.streams and status[n] in (StageStatus.running, StageStatus.queued)
                        and job.stage_record(n).attempts > 0)
                    for n in rec.needs)]


def _raise(exc: Exception) -> Job:
    raise exc


def _slot_of(job: Job, step: Step) -> StageRecord | StepSlot:
    return job.stage_record(step.stage_id) if isinstance(step, RunStage) else job.results


def _slot_prefix(step: Step) -> str:
    """The prefix of a stage's (or the results step's) fields in its job's hash."""
    return f"stage:{step.stage_id}:" if isinstance(step, RunStage) else "results:"


def _slot_guard(step: Step) -> tuple[str, ...]:
    prefix = _slot_prefix(step)
    return (prefix + "status", prefix + "attempts", prefix + "lease_owner")


def _while_held(lease: Lease) -> Change:
    """An empty change that commits only while ``lease`` holds: its job running (a webhook: its
    message sending), its slot running this attempt under this owner. Built from the lease alone,
    for the writes a holder makes while it works (renewals, progress, partial outputs)."""
    change = Change()
    if isinstance(lease.step, DeliverWebhook):
        hooks, name = keys.job_webhooks(lease.job_id), lease.step.message_id
        change.expect(hooks, webhook_field(name, "status"), "sending")
        change.expect(hooks, webhook_field(name, "attempts"), str(lease.attempt))
        change.expect(hooks, webhook_field(name, "lease_owner"), lease.owner)
        return change
    job_key, prefix = keys.job(lease.job_id), _slot_prefix(lease.step)
    change.expect(job_key, "status", JobStatus.running.value)
    change.expect(job_key, prefix + "status", StageStatus.running.value)
    change.expect(job_key, prefix + "attempts", str(lease.attempt))
    change.expect(job_key, prefix + "lease_owner", lease.owner)
    return change


def _holds(job: Job, slot: StageRecord | StepSlot, lease: Lease) -> bool:
    return (not job.status.is_final and slot.status is StageStatus.running and slot.attempts == lease.attempt
            and slot.lease_owner == lease.owner)


def _why_not(slot: StageRecord | StepSlot, attempt: int) -> str:
    if slot.status is StageStatus.running and slot.attempts == attempt:
        return f"attempt {attempt} is running on {slot.worker or 'another worker'}"
    return f"the slot is {slot.status.value} after {slot.attempts} attempt(s), not waiting for attempt {attempt}"
