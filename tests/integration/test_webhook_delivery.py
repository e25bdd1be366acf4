"""Webhook messages, the deliverer and queue positions on a real Redis, delivering to a real loopback
HTTP server (no Celery: the core pieces the webhooks task and the API are made of).

A webhook message is made by the ledger in the same write as the job transition it reports, and
each delivery attempt is a DeliverWebhook step in the outbox; the next attempt, with its backoff,
is queued in the same write that records the failed one. So every test reads the outbox.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import redis
from standardwebhooks.webhooks import Webhook

from omni_jobs.core import keys
from omni_jobs.dispatch.scheduling import Scheduler
from omni_jobs.jobs.ledger import Acquired, JobLedger
from omni_jobs.jobs.models import (
    Job,
    JobError,
    JobWebhook,
    StageRecord,
    WebhookDelivery,
    new_job_id,
    now,
)
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import WEBHOOKS_QUEUE, DeliverWebhook, RunStage, step_id
from omni_jobs.report.webhooks import RetryPolicy, WebhookDeliverer, WebhookSigner, generate_secret
from tests.webhook_receiver import Answer, WebhookReceiver

POLICY = RetryPolicy(base_s=0.1, max_delay_s=2, max_attempts=3)


@dataclass(frozen=True)
class RecordedPolicy(RetryPolicy):
    """POLICY, remembering each delay it gave the deliverer (jitter included), so that a test checks the
    delays themselves and where the deliverer put them, not how long the attempts took."""

    given: list[float] = field(default_factory=list, compare=False)

    def delay(self, attempt: int, retry_after_s: float | None = None,
              rng: Callable[[], float] = random.random) -> float:
        delay = super().delay(attempt, retry_after_s, rng)
        self.given.append(delay)
        return delay


@pytest.fixture
def store(redis_client: redis.Redis) -> RedisJobStore:
    return RedisJobStore(redis_client, ttl_s=3600)


@pytest.fixture
def ledger(store: RedisJobStore) -> JobLedger:
    return JobLedger(store, webhook_progress_interval_s=30, webhook_attempts=POLICY.attempts_for)


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as r:
        yield r


def new_job(ledger: JobLedger, *, webhook: JobWebhook | None = None, stages: tuple[str, ...] = ("ar", "dit")) -> Job:
    """A queued job whose stages run one after the other, the first waiting on its queue."""
    records = [StageRecord(id=s, engine=s, queue=s, needs=list(stages[:i])[-1:]) for i, s in enumerate(stages)]
    job, _ = ledger.submit(Job(id=new_job_id(), pipeline="p", input={"prompt": "x"}, stages=records,
                               webhook=webhook), [stages[0]])
    return job


def start(ledger: JobLedger, job: Job, stage: str = "ar") -> Acquired:
    taken = ledger.acquire(RunStage(job.id, stage, 1, stage), worker="w", owner="w#1")
    assert isinstance(taken, Acquired), taken
    return taken


def webhook_steps(store: RedisJobStore, *, at: float | None = None) -> list[DeliverWebhook]:
    """The delivery attempts due by ``at`` (now), taken from the outbox as the relay takes them;
    other dispatches (the next stage) are taken and dropped."""
    Scheduler(store, None).release_all()  # first attempts wait for their turn
    entries = store.claim_outbox(now=now() if at is None else at, limit=100, hold_s=60.0)
    store.ack_outbox([e.id for e in entries])
    return [e.step for e in entries if isinstance(e.step, DeliverWebhook)]


def sent(store: RedisJobStore) -> list[tuple[str, str]]:
    """(job id, event) of each new message: a first attempt on the webhooks queue."""
    steps = webhook_steps(store)
    assert all(s.attempt == 1 and s.queue == WEBHOOKS_QUEUE for s in steps), steps
    return [(s.job_id, s.event) for s in steps]


def test_events_become_messages_by_filter_with_progress_throttled(ledger: JobLedger, store: RedisJobStore) -> None:
    job = new_job(ledger, webhook=JobWebhook(url="http://h/x", events=["start", "progress", "completed"]))
    quiet = new_job(ledger, webhook=JobWebhook(url="http://h/y", events=["completed"]))
    assert sent(store) == []  # job.queued sends nothing

    running = start(ledger, job)
    start(ledger, quiet)
    assert sent(store) == [(job.id, "start")]
    for step in (1, 2, 3):  # throttled: only the first progress of the interval goes out
        assert ledger.progress(running.lease, running.job, step, 3, "tokens") == "ok"
    assert sent(store) == [(job.id, "progress")]
    assert isinstance(ledger.complete_stage(running.lease, {}, {}), Job)
    assert sent(store) == [(job.id, "progress")]  # a stage end always does
    ledger.cancel(job.id)
    assert sent(store) == [(job.id, "completed")]
    assert ledger.fail(quiet.id, JobError(type="X", message="m"))
    assert sent(store) == [(quiet.id, "completed")]

    # Each message was recorded with the transition: queued, no attempt yet, its own webhook-id.
    slots = {**store.webhook_slots(job.id), **store.webhook_slots(quiet.id)}
    assert len(slots) == 5 and all(m.startswith("msg_") for m in slots)
    assert sorted(s.event for s in store.webhook_slots(job.id).values()) == ["completed", "progress", "progress",
                                                                             "start"]
    assert [s.event for s in store.webhook_slots(quiet.id).values()] == ["completed"]
    assert {(s.status, s.attempts) for s in slots.values()} == {("queued", 0)}
    assert store.queue_counts(WEBHOOKS_QUEUE) == (5, 0)
    no_hook = new_job(ledger)
    ledger.cancel(no_hook.id)
    assert sent(store) == [] and store.webhook_slots(no_hook.id) == {}


def test_queue_positions_follow_the_job_events(ledger: JobLedger) -> None:
    jobs = [new_job(ledger) for _ in range(3)]

    def positions() -> list[int | None]:
        return [ledger.queue_position(ledger.require(j.id)) for j in jobs]

    assert positions() == [1, 2, 3]
    first = start(ledger, jobs[0])
    ledger.cancel(jobs[1].id)
    assert positions() == [None, None, 1]
    # The first job's next stage is queued by its first stage's success, on another queue, where it is first.
    ledger.complete_stage(first.lease, {}, {})
    assert positions() == [1, None, 1]
    assert ledger.require(jobs[0].id).stage is None and ledger.store.queue_counts("dit") == (1, 0)


def _deliverer(ledger: JobLedger, secret: str, *, timeout_s: float = 5.0,
               policy: RetryPolicy = POLICY) -> WebhookDeliverer:
    return WebhookDeliverer(ledger=ledger, render=lambda j: j.model_dump(mode="json"),
                            signer=WebhookSigner.from_setting(secret), policy=policy, timeout_s=timeout_s)


def deliveries(ledger: JobLedger, job_id: str) -> list[WebhookDelivery]:
    hook = ledger.require(job_id).webhook
    assert hook is not None
    return hook.deliveries


def test_deliverer_signs_records_and_schedules_retries(ledger: JobLedger, store: RedisJobStore,
                                                       redis_client: redis.Redis, receiver: WebhookReceiver) -> None:
    secret = generate_secret()
    url = receiver.script("/hook", [Answer(503, {"Retry-After": "1"}), Answer(302, {"Location": "/elsewhere"})])
    job = new_job(ledger, webhook=JobWebhook(url=url, events=["completed"]))
    ledger.cancel(job.id)
    (first,) = webhook_steps(store)
    mid = first.message_id
    deliverer = _deliverer(ledger, secret)

    outcome = deliverer.run(first, worker="wh", owner="wh#1")
    assert (outcome.status, outcome.detail) == ("retry", "HTTP 503 Service Unavailable")
    slot = store.webhook_slots(job.id)[mid]
    assert (slot.status, slot.attempts, slot.lease_owner) == ("queued", 1, None)
    # Attempt 2 (same webhook-id) is in the outbox, due when the receiver asked: Retry-After honoured.
    second = DeliverWebhook(job.id, mid, "completed", 2)
    due = redis_client.zscore(keys.OUTBOX, step_id(second))
    assert due is not None and due - deliveries(ledger, job.id)[0].at == pytest.approx(1.0, abs=0.2)
    assert webhook_steps(store) == []  # not due yet
    assert deliverer.run(first, worker="wh", owner="wh#2").status == "skipped"  # attempt 1 redelivered: not sent
    assert webhook_steps(store, at=due) == [second]

    again = deliverer.run(second, worker="wh", owner="wh#1")
    assert (again.status, again.detail) == ("rejected", "HTTP 302 Found")  # a redirect is an answer, not followed
    assert store.webhook_slots(job.id)[mid].status == "rejected"
    assert webhook_steps(store, at=now() + 3600) == [] and store.queue_counts(WEBHOOKS_QUEUE) == (0, 0)
    assert store.leased_slots() == []
    got = receiver.at("/hook")
    assert len(got) == 2 and {r.message_id for r in got} == {mid}
    for r in got:
        body = Webhook(secret).verify(r.body, r.headers)
        assert body["id"] == job.id and r.headers["omni-webhook-event"] == "completed"
    assert len(receiver.at("/elsewhere")) == 0

    recorded = deliveries(ledger, job.id)
    assert [(d.id, d.event, d.attempt, d.status_code) for d in recorded] == [(mid, "completed", 1, 503),
                                                                           (mid, "completed", 2, 302)]
    assert recorded[0].error == "HTTP 503 Service Unavailable" and recorded[0].duration_s is not None
    assert recorded[0].duration_s > 0


def run_all_attempts(deliverer: WebhookDeliverer, ledger: JobLedger, store: RedisJobStore, first: DeliverWebhook,
                     policy: RecordedPolicy) -> tuple[list[str], list[float]]:
    """Run a message's attempts as they come due: (each outcome, each delay the policy gave after a failed
    attempt). Each next attempt must be due in the outbox that delay after the moment its failure was
    recorded: after the attempt was recorded, before ``run`` returned (an order, not a time window)."""
    outcomes: list[str] = []
    step: DeliverWebhook | None = first
    del policy.given[:]
    while step is not None:
        given = len(policy.given)
        before = now()
        outcome = deliverer.run(step, worker="wh", owner="wh#1")
        after = now()
        outcomes.append(outcome.status)
        nxt = DeliverWebhook(step.job_id, step.message_id, step.event, step.attempt + 1)
        due = store.redis.zscore(keys.OUTBOX, step_id(nxt))
        assert len(policy.given) == given + (due is not None), "a retry is scheduled by the policy's delay"
        if due is not None:
            failed_at = float(due) - policy.given[-1]
            recorded = deliveries(ledger, step.job_id)[-1]
            ulp = 1e-6  # due - delay need not give back the float the deliverer added the delay to
            assert recorded.attempt == step.attempt and before <= recorded.at <= failed_at + ulp, (before, recorded.at,
                                                                                                   failed_at)
            assert failed_at <= after + ulp, (failed_at, after)
        found = webhook_steps(store, at=now() + 60)
        assert found == ([nxt] if due is not None else []), found
        step = found[0] if found else None
    return outcomes, list(policy.given)


def test_timeouts_and_refused_connections_are_retried_then_given_up(
        ledger: JobLedger, store: RedisJobStore, receiver: WebhookReceiver) -> None:
    policy = RecordedPolicy(base_s=0.1, max_delay_s=2, max_attempts=3)
    deliverer = _deliverer(ledger, generate_secret(), timeout_s=0.3, policy=policy)
    slow = receiver.script("/slow", [], Answer(200, delay_s=1.0))
    job = new_job(ledger, webhook=JobWebhook(url=slow, events=["start"]))
    start(ledger, job)
    (first,) = webhook_steps(store)
    outcomes, delays = run_all_attempts(deliverer, ledger, store, first, policy)
    assert outcomes == ["retry", "gave_up"]  # start: one retry only
    assert len(delays) == 1 and 0.075 <= delays[0] <= 0.125  # 0.1 s +/- 25 % jitter
    assert store.webhook_slots(job.id)[first.message_id].status == "gave_up"

    closed = receiver.url("/x").replace(str(receiver.server.server_address[1]), "9")  # discard port: refused
    other = new_job(ledger, webhook=JobWebhook(url=closed, events=["completed"]))
    ledger.cancel(other.id)
    (completed,) = webhook_steps(store)
    outcomes, delays = run_all_attempts(deliverer, ledger, store, completed, policy)
    assert outcomes == ["retry", "retry", "gave_up"]  # completed: POLICY.max_attempts
    assert len(delays) == 2 and 0.075 <= delays[0] <= 0.125 and 0.15 <= delays[1] <= 0.25  # the delay doubles
    assert store.webhook_slots(other.id)[completed.message_id].status == "gave_up"

    timed_out, refused = deliveries(ledger, job.id), deliveries(ledger, other.id)
    assert [r.error.split(":")[0] for r in timed_out] == ["timeout", "timeout"]  # type: ignore[union-attr]
    assert [r.error.split(":")[0] for r in refused] == ["ConnectError"] * 3  # type: ignore[union-attr]
    assert [r.attempt for r in refused] == [1, 2, 3] and {r.id for r in refused} == {completed.message_id}
    assert all(r.status_code is None for r in timed_out + refused)
    assert store.queue_counts(WEBHOOKS_QUEUE) == (0, 0)
    assert store.leased_slots() == [f"stage:{job.id}:ar"]  # the stage still runs; no delivery holds a lease
