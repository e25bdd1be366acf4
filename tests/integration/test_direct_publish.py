"""Where the job store's Redis is also the broker, a commit publishes its own steps: it runs the
scheduler's pass for its queues and pushes the task messages onto the Celery queues in the same
script (RedisJobStore.publish_in_commit). Real Redis; what a worker would take is read back with
kombu's Redis transport itself."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial

import pytest
import redis
from celery import Celery
from celery.app.task import Context
from kombu import Connection

from omni_jobs.core import keys
from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.outbox import OutboxRelay
from omni_jobs.dispatch.queueing import (
    SNAPSHOT_HEADER,
    broker_message,
    broker_message_templates,
    celery_config,
    job_snapshot,
    publish_steps,
)
from omni_jobs.dispatch.scheduling import Scheduler
from omni_jobs.jobs.change import Change, ReleasePass
from omni_jobs.jobs.ledger import Acquired, JobLedger
from omni_jobs.jobs.models import Job, StageRecord, new_job_id, now
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import RUN_STAGE_TASK, AssembleResults, DeliverWebhook, RunStage, Step, step_id

pytestmark = pytest.mark.integration


def two_stage_job() -> Job:
    return Job(id=new_job_id(), pipeline="p", input={}, tenant="t",
               stages=[StageRecord(id="ar", engine="ar", queue="ar"),
                       StageRecord(id="dit", engine="dit", queue="dit", needs=["ar"])])


def system(client: redis.Redis, capacity: dict[str, int]) -> tuple[RedisJobStore, JobLedger, Scheduler]:
    """A store that is the broker, with a scheduler that has read the workers' ``capacity`` once."""
    store = RedisJobStore(client, ttl_s=3600, broker_templates=broker_message_templates())
    scheduler = Scheduler(store, lambda: dict(capacity), slack=0)
    store.publish_in_commit(scheduler.windows_for)
    scheduler.windows()  # the relay's first pass reads the capacity; commits use what it read
    return store, JobLedger(store, lease_s=30.0), scheduler


def queued_tasks(client: redis.Redis, queue: str) -> list[str]:
    """Task ids on a Celery queue, oldest first (kombu pushes left, pops right)."""
    return [json.loads(raw)["headers"]["id"] for raw in reversed(client.lrange(queue, 0, -1))]


def finish(ledger: JobLedger, step: RunStage) -> None:
    taken = ledger.acquire(step, worker="w", owner="w#1")
    assert isinstance(taken, Acquired), taken
    ledger.complete_stage(taken.lease, {}, {})


def test_a_submit_puts_its_first_stage_on_the_queue_in_its_own_commit(redis_client: redis.Redis) -> None:
    store, ledger, _ = system(redis_client, {"ar": 2, "dit": 1})
    jobs = [ledger.submit(two_stage_job(), ["ar"])[0].id for _ in range(3)]
    # The window of ar is 2: two went out with their submits, the third waits for a place.
    assert queued_tasks(redis_client, "ar") == [f"stage:{j}:ar:1" for j in jobs[:2]]
    assert redis_client.zcard(keys.OUTBOX) == 0  # nothing left for a relay
    assert redis_client.hkeys(keys.OUTBOX_ITEMS) == [f"stage:{jobs[2]}:ar:1".encode()]
    assert store.queue_counts("ar") == (3, 0)

    # The end of a stage frees its place and readies the next stage: both go out in that commit.
    finish(ledger, RunStage(jobs[0], "ar", 1, "ar"))
    assert queued_tasks(redis_client, "ar")[-1] == f"stage:{jobs[2]}:ar:1"
    assert queued_tasks(redis_client, "dit") == [f"stage:{jobs[0]}:dit:1"]
    assert redis_client.hlen(keys.OUTBOX_ITEMS) == 0


def test_a_worker_takes_the_pushed_message_as_celery_sent_it(redis_client: redis.Redis, redis_url: str) -> None:
    _, ledger, _ = system(redis_client, {"ar": 1})
    job_id = ledger.submit(two_stage_job(), ["ar"])[0].id
    with Connection(redis_url) as conn:  # kombu's Redis transport: what a Celery worker consumes with
        message = conn.default_channel.basic_get("ar")
        assert message is not None
        args, kwargs, _ = message.decode()
        assert message.headers["task"] == RUN_STAGE_TASK and message.headers["id"] == f"stage:{job_id}:ar:1"
        assert (args, kwargs) == ([job_id, "ar", 1], {})
        assert message.headers["shadow"] == f"{RUN_STAGE_TASK}[{job_id}/ar#1]"  # Flower's name for it
        # The job as the commit left it rides along: the worker starts the stage without reading it.
        assert job_snapshot(message.headers[SNAPSHOT_HEADER], job_id) == ledger.require(job_id)
        assert Context(message.headers).omni_job == message.headers[SNAPSHOT_HEADER]  # task.request.omni_job
        message.ack()


def celery_publisher(redis_url: str) -> Callable[[list[Step], list[str]], None]:
    """The relay's kombu path, as the API and workers use it: a real Celery app on this Redis."""
    app = Celery("direct-publish-test")
    app.conf.update(celery_config(Settings(redis_url=redis_url)))
    return partial(publish_steps, app)


def test_without_a_live_worker_or_a_first_pass_the_relay_publishes(redis_client: redis.Redis,
                                                                   redis_url: str) -> None:
    store = RedisJobStore(redis_client, ttl_s=3600, broker_templates=broker_message_templates())
    capacity: dict[str, int] = {}
    scheduler = Scheduler(store, lambda: dict(capacity), slack=0, refresh_s=0.0)
    store.publish_in_commit(scheduler.windows_for)
    ledger = JobLedger(store, lease_s=30.0)
    relay = OutboxRelay(store, celery_publisher(redis_url), scheduler=scheduler)
    job_id = ledger.submit(two_stage_job(), ["ar"])[0].id  # no pass read the capacity yet: the relay's turn
    assert redis_client.llen("ar") == 0
    capacity["ar"] = 1  # a worker came up
    assert relay.run_once() == 1
    # The relay's script pushed it, with the script's own message (not kombu's), and only once.
    (raw,) = redis_client.lrange("ar", 0, -1)
    message = json.loads(raw)
    carried = job_snapshot(message["headers"].pop(SNAPSHOT_HEADER), job_id)
    assert message == json.loads(broker_message(RunStage(job_id, "ar", 1, "ar"), f"stage:{job_id}:ar:1"))
    assert carried == ledger.require(job_id)  # as it was when the relay's script pushed it
    assert relay.run_once() == 0 and redis_client.llen("ar") == 1


def test_a_store_that_is_not_the_broker_leaves_publishing_to_the_relay(redis_client: redis.Redis,
                                                                       redis_url: str) -> None:
    store = RedisJobStore(redis_client, ttl_s=3600)  # as with a broker elsewhere (OMNI_BROKER_URL)
    scheduler = Scheduler(store, lambda: {"ar": 1}, slack=0)
    store.publish_in_commit(scheduler.windows_for)
    scheduler.windows()
    ledger = JobLedger(store, lease_s=30.0)
    job_id = ledger.submit(two_stage_job(), ["ar"])[0].id
    assert redis_client.llen("ar") == 0  # the commit published nothing
    relay = OutboxRelay(store, celery_publisher(redis_url), scheduler=scheduler)
    assert relay.run_once() == 1
    (raw,) = redis_client.lrange("ar", 0, -1)  # kombu's message this time: base64 body, a random tag
    message = json.loads(raw)
    assert message["headers"]["id"] == f"stage:{job_id}:ar:1" and message["properties"]["body_encoding"] == "base64"
    assert redis_client.zcard(keys.OUTBOX) == 0  # acknowledged after the publish


def test_the_script_writes_each_kinds_message_as_celery_would(redis_client: redis.Redis) -> None:
    store, _, _ = system(redis_client, {})
    job_id = new_job_id()
    steps: list[Step] = [RunStage(job_id, "vocoder-2", 3, "audio.v2"), AssembleResults(job_id, 1),
                         DeliverWebhook(job_id, "msg_5f3a", "job.succeeded", 2)]
    change = Change()
    for step in steps:
        change.dispatch(step, now())
    assert store.commit(change) is None and change.passed is not None and change.passed.published == 3
    for step in steps:
        (raw,) = redis_client.lrange(step.queue, 0, -1)
        no_job = {SNAPSHOT_HEADER: None} if isinstance(step, RunStage) else None  # none stored: nothing to carry
        assert raw == broker_message(step, step_id(step), no_job).encode()  # byte for byte


def test_a_value_that_is_not_plain_text_is_left_to_the_relay(redis_client: redis.Redis) -> None:
    store, _, _ = system(redis_client, {})
    odd = DeliverWebhook(new_job_id(), "msg_1", 'job "done"', 1)  # a quote would need JSON escaping
    change = Change().dispatch(odd, now())
    assert store.commit(change) is None and change.passed is not None and change.passed.published == 0
    assert redis_client.llen(odd.queue) == 0
    assert [e.step for e in store.claim_outbox(now=now(), limit=10, hold_s=5)] == [odd]  # kombu's turn


def test_a_commits_pass_tells_the_scheduler_only_about_the_queues_it_looked_at(redis_client: redis.Redis) -> None:
    store, _, scheduler = system(redis_client, {"ar": 1, "dit": 1})
    scheduler.passed(ReleasePass([], frozenset({"dit"})))  # the relay's last pass left dit full
    step, waiting = RunStage(new_job_id(), "ar", 1, "ar"), RunStage(new_job_id(), "dit", 1, "dit")
    change = Change().schedule(step, tenant="t", order=now()).schedule(waiting, tenant="t", order=now())
    assert store.commit(change) is None and change.passed is not None
    assert change.passed.queues == {"ar"} and change.passed.full == {"ar"}  # window 1: now full; dit not looked at
    scheduler.passed_in_commit(change)
    assert not scheduler.may_release({"ar"}) and not scheduler.may_release({"dit"})  # dit is still full
    assert queued_tasks(redis_client, "ar") == [step_id(step)] and redis_client.llen("dit") == 0
