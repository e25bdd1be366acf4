"""Webhook notifier, deliverer and queue positions on a real Redis, delivering to a real loopback
HTTP server (no Celery: the core pieces the webhooks task and the API are made of)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from standardwebhooks.webhooks import Webhook

from omni_jobs.dispatch import NextStep
from omni_jobs.jobs import state
from omni_jobs.jobs.models import Job, JobError, JobEvent, JobWebhook, StageRecord, new_job_id, now
from omni_jobs.jobs.store import JobStore
from omni_jobs.webhooks import RetryPolicy, WebhookDeliverer, WebhookNotifier, WebhookSigner, generate_secret
from tests.webhook_receiver import Answer, WebhookReceiver


class RecordingDispatcher:
    def __init__(self) -> None:
        self.steps: list[NextStep] = []

    def dispatch(self, step: NextStep) -> None:
        self.steps.append(step)

    def events(self) -> list[str]:
        return [s.webhook.event for s in self.steps if s.webhook is not None]


@pytest.fixture
def store(redis_client: redis.Redis) -> JobStore:
    return JobStore(redis_client, ttl_s=3600)


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as r:
        yield r


def new_job(store: JobStore, *, webhook: JobWebhook | None = None, stages: tuple[str, ...] = ("ar", "dit")) -> Job:
    job = Job(id=new_job_id(), pipeline="p", input={"prompt": "x"},
              stages=[StageRecord(id=s, engine=s, queue=s) for s in stages], webhook=webhook)
    at = now()
    store.create(job, [JobEvent(job_id=job.id, type="job.queued", at=at), *state.stage_queued(job, stages[0], at)])
    return job


def test_events_become_messages_by_filter_with_progress_throttled(store: JobStore) -> None:
    dispatcher = RecordingDispatcher()
    store.listeners.append(WebhookNotifier(store.redis, dispatcher, progress_interval_s=30))
    job = new_job(store, webhook=JobWebhook(url="http://h/x", events=["start", "progress", "completed"]))
    quiet = new_job(store, webhook=JobWebhook(url="http://h/y", events=["completed"]))
    assert dispatcher.steps == []  # job.queued sends nothing

    store.update(job.id, lambda j: state.stage_started(j, "ar", "w", now()))
    store.update(quiet.id, lambda j: state.stage_started(j, "ar", "w", now()))
    for step in (1, 2, 3):  # throttled: only the first progress of the interval goes out
        store.update(job.id, lambda j, s=step: state.stage_progress(j, "ar", s, 3, "tokens", now()))  # type: ignore[misc]
    store.update(job.id, lambda j: state.stage_succeeded(j, "ar", {}, {}, now()))  # a stage end always does
    store.update(job.id, lambda j: state.job_canceled(j, now()))
    store.update(quiet.id, lambda j: state.job_failed(j, JobError(type="X", message="m"), now()))

    by_job = [(s.job_id, s.webhook.event) for s in dispatcher.steps if s.webhook]
    assert by_job == [(job.id, "start"), (job.id, "progress"), (job.id, "progress"), (job.id, "completed"),
                      (quiet.id, "completed")]
    assert all(s.queue == "webhooks" and s.stage_id is None for s in dispatcher.steps)
    assert len({s.webhook.message_id for s in dispatcher.steps if s.webhook}) == 5
    no_hook = new_job(store)
    store.update(no_hook.id, lambda j: state.job_canceled(j, now()))
    assert len(dispatcher.steps) == 5


def test_queue_positions_follow_the_job_events(store: JobStore) -> None:
    jobs = [new_job(store) for _ in range(3)]
    assert [store.queue_position(store.require(j.id)) for j in jobs] == [1, 2, 3]
    store.update(jobs[0].id, lambda j: state.stage_started(j, "ar", "w", now()))
    store.update(jobs[1].id, lambda j: state.job_canceled(j, now()))
    assert [store.queue_position(store.require(j.id)) for j in jobs] == [None, None, 1]
    # The first job's next stage waits on another queue, where it is first.
    store.update(jobs[0].id, lambda j: state.stage_succeeded(j, "ar", {}, {}, now()))
    store.update(jobs[0].id, lambda j: state.stage_queued(j, "dit", now()))
    assert store.queue_position(store.require(jobs[0].id)) == 1


def _deliverer(store: JobStore, secret: str, *, timeout_s: float = 5.0) -> WebhookDeliverer:
    return WebhookDeliverer(store=store, render=lambda j: j.model_dump(mode="json"),
                            signer=WebhookSigner.from_setting(secret),
                            policy=RetryPolicy(base_s=0.1, max_delay_s=2, max_attempts=3),
                            timeout_s=timeout_s, deliveries_kept=100)


def test_deliverer_signs_records_and_schedules_retries(store: JobStore, receiver: WebhookReceiver) -> None:
    secret = generate_secret()
    url = receiver.script("/hook", [Answer(503, {"Retry-After": "1"}), Answer(302, {"Location": "/elsewhere"})])
    job = new_job(store, webhook=JobWebhook(url=url, events=["completed"]))
    deliverer = _deliverer(store, secret)

    first = deliverer.deliver(job.id, "msg_1", "completed", attempt=1)
    assert (first.status, first.retry_in_s, first.status_code) == ("retry", 1.0, 503)  # Retry-After honoured
    second = deliverer.deliver(job.id, "msg_1", "completed", attempt=2)
    assert (second.status, second.retry_in_s) == ("rejected", None)  # a redirect is an answer, not followed
    got = receiver.at("/hook")
    assert len(got) == 2 and {r.message_id for r in got} == {"msg_1"}
    for r in got:
        body = Webhook(secret).verify(r.body, r.headers)
        assert body["id"] == job.id and r.headers["omni-webhook-event"] == "completed"
    assert len(receiver.at("/elsewhere")) == 0

    deliveries = store.require(job.id).webhook.deliveries  # type: ignore[union-attr]
    assert [(d.id, d.attempt, d.status_code) for d in deliveries] == [("msg_1", 1, 503), ("msg_1", 2, 302)]
    assert deliveries[0].error == "HTTP 503 Service Unavailable" and deliveries[0].duration_s > 0


def test_timeouts_and_refused_connections_are_retried_then_given_up(store: JobStore,
                                                                    receiver: WebhookReceiver) -> None:
    slow = receiver.script("/slow", [], Answer(200, delay_s=1.0))
    job = new_job(store, webhook=JobWebhook(url=slow, events=["start"]))
    deliverer = _deliverer(store, generate_secret(), timeout_s=0.3)
    outcome = deliverer.deliver(job.id, "msg_s", "start", attempt=1)
    assert outcome.status == "retry" and 0.075 <= outcome.retry_in_s <= 0.125  # type: ignore[operator]
    assert deliverer.deliver(job.id, "msg_s", "start", attempt=2).status == "gave_up"  # start: one retry only

    closed = receiver.url("/x").replace(str(receiver.server.server_address[1]), "9")  # discard port: refused
    store.update(job.id, lambda j: _set_url(j, closed))
    assert deliverer.deliver(job.id, "msg_c", "completed", attempt=3).status == "gave_up"
    records = store.require(job.id).webhook.deliveries  # type: ignore[union-attr]
    assert [r.error.split(":")[0] for r in records] == ["timeout", "timeout", "ConnectError"]  # type: ignore[union-attr]
    assert all(r.status_code is None for r in records)


def _set_url(job: Job, url: str) -> list[JobEvent]:
    assert job.webhook is not None
    job.webhook.url = url
    return []
