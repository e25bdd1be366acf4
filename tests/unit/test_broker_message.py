"""The task message a store pushes onto a queue itself (omni_jobs.dispatch.queueing.broker_message) is the one
Celery and kombu would have sent: compared here with what ``publish_steps`` sends through a real
Celery app (kombu's in-memory transport, the same virtual-transport code as its Redis one)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu.transport.virtual import Message as VirtualMessage

from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.queueing import SNAPSHOT_HEADER, broker_message, broker_message_templates, publish_steps
from omni_jobs.jobs.steps import (
    AssembleResults,
    DeliverWebhook,
    RunStage,
    Step,
    from_task,
    step_id,
)

STEPS: list[Step] = [RunStage("job_0123abcd", "dit", 2, "dit"), AssembleResults("job_0123abcd", 1),
                     DeliverWebhook("job_0123abcd", "msg_7", "job.succeeded", 3)]


@pytest.fixture(scope="module")
def app() -> Iterator[Celery]:
    from omni_jobs.dispatch.queueing import celery_config

    app = Celery("broker-message-test")
    app.conf.update(celery_config(Settings(redis_url="redis://unused:1/0")))
    app.conf.broker_url = "memory://"
    yield app


def sent_by_celery(app: Celery, step: Step) -> dict[str, Any]:
    """The raw message kombu keeps for ``step`` when Celery publishes it."""
    publish_steps(app, [step], [step_id(step)])
    with app.connection_for_write() as conn:
        message = conn.default_channel.basic_get(step.queue)
        assert message is not None
        raw: dict[str, Any] = message._raw
        return raw


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.kind.value)
def test_the_message_is_the_one_celery_sends(app: Celery, step: Step) -> None:
    ours = json.loads(broker_message(step, step_id(step)))
    theirs = sent_by_celery(app, step)
    ignore = {"origin"}  # the sending host: ours names no host
    assert {k: v for k, v in ours["headers"].items() if k not in ignore} == \
        {k: v for k, v in theirs["headers"].items() if k not in ignore}
    per_publish = {"reply_to", "delivery_tag", "body_encoding"}  # a random tag; base64 is optional for kombu
    assert {k: v for k, v in ours["properties"].items() if k not in per_publish} == \
        {k: v for k, v in theirs["properties"].items() if k not in per_publish}
    assert ours["properties"]["delivery_tag"] == step_id(step)  # unique per entry: the unacked set's key
    assert (ours["content-type"], ours["content-encoding"]) == (theirs["content-type"], theirs["content-encoding"])


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.kind.value)
def test_kombu_decodes_it_to_the_same_task(app: Celery, step: Step) -> None:
    theirs = sent_by_celery(app, step)
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        ours = VirtualMessage(json.loads(broker_message(step, step_id(step))), channel=channel)
        celerys = VirtualMessage(theirs, channel=channel)
        assert ours.decode() == celerys.decode()
        args, kwargs, _embed = ours.decode()
        assert kwargs == {} and from_task(ours.headers["task"], args, step.queue) == step
        assert ours.delivery_info == {"exchange": "", "routing_key": step.queue}


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.kind.value)
def test_each_kinds_template_filled_in_is_the_message(step: Step) -> None:
    """What the store's scripts do with a template (RedisJobStore: publish), done here in Python."""
    template = broker_message_templates()[step.kind.value]
    values = {"ID": step_id(step), "JOB": step.job_id, "ATTEMPT": str(step.attempt), "QUEUE": step.queue,
              "STAGE": getattr(step, "stage_id", ""), "MSG": getattr(step, "message_id", ""),
              "EVENT": getattr(step, "event", "")}
    # A stage's message carries its job where "@@SNAPSHOT@@" stands: null here, where none is stored.
    carried = {SNAPSHOT_HEADER: None} if isinstance(step, RunStage) else None
    filled = re.sub(r"@@([A-Z]+)@@", lambda m: values[m.group(1)], template.replace('"@@SNAPSHOT@@"', "null"))
    assert filled == broker_message(step, step_id(step), carried)
