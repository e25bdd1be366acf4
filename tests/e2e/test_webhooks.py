"""Webhooks end to end: real API, Celery workers (a threads-pool webhooks worker), and a real HTTP
receiver on loopback that fails on purpose. Signatures are checked with the PyPI
``standardwebhooks`` library, never with our own verifier. The test system's schedule is short
(0.2 s base, 4 attempts: tests/e2e/conftest.py)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.conftest import WEBHOOK_SECRETS
from tests.e2e.helpers import wait_for_job
from tests.e2e.job_contract import assert_job_view
from tests.webhook_receiver import Answer, Received, WebhookReceiver

MAX_ATTEMPTS = 4  # OMNI_WEBHOOK_MAX_ATTEMPTS in the test system


@pytest.fixture(scope="module")
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as r:
        yield r


def verify(received: Received) -> dict[str, Any]:
    """Each secret of the rotation pair verifies the delivery on its own."""
    bodies = [Webhook(secret).verify(received.body, received.headers) for secret in WEBHOOK_SECRETS]
    assert bodies[0] == bodies[1]
    body: dict[str, Any] = bodies[0]
    assert_job_view({k: v for k, v in body.items() if k != "preview"})  # the job, plus a preview's data
    return body


def submit_with_webhook(api: httpx.Client, url: str, events: list[str] | None, pipeline: str = "text-to-text",
                        params: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"pipeline": pipeline, "input": {"prompt": "a webhook test"},
                            "params": params or {"ar": {"max_tokens": 6}}, "webhook": url}
    if events is not None:
        body["webhook_events_filter"] = events
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return response.json()


def deliveries(api: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    job = api.get(f"/v1/jobs/{job_id}").json()
    return list(job["webhook"]["deliveries"])


def wait_for_deliveries(api: httpx.Client, job_id: str, count: int, timeout_s: float = 30) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = deliveries(api, job_id)
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"job {job_id}: {len(found)} delivery attempts recorded, wanted {count}: {found}")


def test_completed_webhook_is_retried_until_delivered_with_a_stable_id(
    api: httpx.Client, receiver: WebhookReceiver, system: EmbeddedSystem
) -> None:
    url = receiver.script("/flaky", [Answer(500), Answer(429, {"Retry-After": "1"})])
    accepted = submit_with_webhook(api, url, ["completed"])
    assert accepted["webhook"] == {"url": url, "events": ["completed"], "deliveries": []}
    job = wait_for_job(api, accepted["id"])
    assert job["status"] == "succeeded"

    records = wait_for_deliveries(api, job["id"], 3)
    got = receiver.at("/flaky")
    assert [r.answered for r in got] == [500, 429, 200]
    assert len({r.message_id for r in got}) == 1 and got[0].message_id.startswith("msg_")
    assert {r.headers["omni-webhook-event"] for r in got} == {"completed"}
    assert all(r.headers["content-type"] == "application/json" for r in got)
    bodies = [verify(r) for r in got]
    assert {b["id"] for b in bodies} == {job["id"]} and {b["status"] for b in bodies} == {"succeeded"}
    assert bodies[-1]["outputs"][0]["text"] == job["outputs"][0]["text"]
    # The body is the job as GET shows it; by the third attempt it records the first two.
    assert [(d["attempt"], d["status_code"]) for d in bodies[2]["webhook"]["deliveries"]] == [(1, 500), (2, 429)]
    # Backoff after the 500 (0.2 s +/- 25%), then exactly what Retry-After asked for.
    assert got[1].at - got[0].at >= 0.14
    assert got[2].at - got[1].at >= 0.95

    assert [(d["id"], d["event"], d["attempt"], d["status_code"]) for d in records] == [
        (got[0].message_id, "completed", n, code) for n, code in ((1, 500), (2, 429), (3, 200))]
    assert records[0]["error"].startswith("HTTP 500") and records[1]["error"].startswith("HTTP 429")
    assert records[2]["error"] is None
    assert all(d["duration_s"] > 0 for d in records)
    assert [d["at"] for d in records] == sorted(d["at"] for d in records)
    time.sleep(0.5)
    assert len(receiver.at("/flaky")) == 3  # nothing after the success

    # The secret never appears in what clients or receivers see.
    text = api.get(f"/v1/jobs/{job['id']}").text
    for secret in WEBHOOK_SECRETS:
        assert secret not in text and secret[6:] not in text
        assert all(secret[6:].encode() not in r.body for r in got)


def test_intermediate_events_are_retried_once_and_completed_up_to_the_limit(
    api: httpx.Client, receiver: WebhookReceiver
) -> None:
    url = receiver.script("/down", [], Answer(500))
    params = {"ar": {"max_tokens": 4}, "dit": {"height": 32, "width": 32, "num_inference_steps": 3}}
    accepted = submit_with_webhook(api, url, None, pipeline="text-to-image", params=params)
    assert accepted["webhook"]["events"] == ["start", "progress", "completed"]  # the default filter
    job = wait_for_job(api, accepted["id"])
    assert job["status"] == "succeeded"

    def settled() -> bool:
        counts = Counter((r.message_id, r.headers["omni-webhook-event"]) for r in receiver.at("/down"))
        done = [n == (MAX_ATTEMPTS if event == "completed" else 2) for (_, event), n in counts.items()]
        return any(event == "completed" for _, event in counts) and all(done)

    receiver.wait_until(settled, what="every message to reach its last attempt")
    time.sleep(1.0)  # a stray extra attempt would show up here
    got = receiver.at("/down")
    attempts = Counter((r.message_id, r.headers["omni-webhook-event"]) for r in got)
    per_event: dict[str, list[int]] = {}
    for (_, event), n in attempts.items():
        per_event.setdefault(event, []).append(n)
    assert per_event["start"] == [2]
    assert per_event["completed"] == [MAX_ATTEMPTS]
    # progress: at least each stage's end (ar, dit); each message tried twice, never more.
    assert len(per_event["progress"]) >= 2 and set(per_event["progress"]) == {2}
    for r in got:
        assert verify(r)["id"] == job["id"]

    records = wait_for_deliveries(api, job["id"], len(got))
    assert len(records) == len(got)
    assert Counter((d["id"], d["event"]) for d in records) == attempts
    assert {d["status_code"] for d in records} == {500}


def test_a_4xx_answer_is_not_retried(api: httpx.Client, receiver: WebhookReceiver) -> None:
    url = receiver.script("/gone", [], Answer(410))
    job = wait_for_job(api, submit_with_webhook(api, url, ["completed"])["id"])
    (record,) = wait_for_deliveries(api, job["id"], 1)
    time.sleep(1.0)
    assert len(receiver.at("/gone")) == 1
    assert (record["status_code"], record["error"]) == (410, "HTTP 410 Gone")


def test_a_canceled_job_sends_completed_from_the_api(api: httpx.Client, receiver: WebhookReceiver) -> None:
    url = receiver.script("/canceled", [])
    params = {"ar": {"max_tokens": 4}, "dit": {"height": 256, "width": 256, "num_inference_steps": 200}}
    job = submit_with_webhook(api, url, ["completed"], pipeline="text-to-image", params=params)
    canceled = api.post(f"/v1/jobs/{job['id']}/cancel")
    assert canceled.status_code == 200 and canceled.json()["status"] == "canceled"
    receiver.wait_until(lambda: len(receiver.at("/canceled")) == 1, what="the completed webhook")
    (r,) = receiver.at("/canceled")
    body = verify(r)
    assert (body["id"], body["status"]) == (job["id"], "canceled")


@pytest.mark.parametrize(
    ("extra", "loc", "fragment"),
    [
        ({"webhook": "ftp://example.com/hook"}, ["body", "webhook"], "http:// or https://"),
        ({"webhook": "https:///no-host"}, ["body", "webhook"], "no host"),
        ({"webhook": "https://example.com/h", "webhook_events_filter": ["done"]},
         ["body", "webhook_events_filter", 0], "'progress', 'completed' or 'preview'"),
        ({"webhook_events_filter": ["completed"]}, ["body", "webhook_events_filter"], "no 'webhook' URL"),
    ],
)
def test_bad_webhook_fields_are_422_naming_the_field(api: httpx.Client, extra: dict[str, Any], loc: list[Any],
                                                     fragment: str) -> None:
    body = {"pipeline": "text-to-text", "input": {"prompt": "x"}, **extra}
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert any(d["loc"] == loc and fragment in d["msg"] for d in detail), json.dumps(detail)
