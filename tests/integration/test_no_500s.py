"""Inputs that once answered 500 or crashed a task (issue 62, "Answers of 500, or crashes"), through the
real app on real Redis, and a real loopback webhook receiver: each is a 4xx, or a retry that is handled."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from omni_jobs.accept.auth import ApiKeys
from omni_jobs.core.settings import Settings
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import Job, JobWebhook, StageRecord, new_job_id
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import DeliverWebhook
from omni_jobs.report.webhooks import RetryPolicy, WebhookDeliverer, WebhookSigner, generate_secret, parse_retry_after
from tests.webhook_receiver import Answer, WebhookReceiver

DEEP = 2000
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


@pytest.fixture
def settings(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, artifacts_dir=tmp_path / "artifacts", models_dir=tmp_path / "models")


@pytest.fixture
def key(redis_client: redis.Redis) -> str:
    return ApiKeys(redis_client).create("acme", "no-500s")[0]


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings), raise_server_exceptions=False, follow_redirects=False) as c:
        yield c


def deep_json(depth: int) -> str:
    return '{"pipeline": "text-to-text", "input": {"prompt": ' + "[" * depth + "]" * depth + "}}"


@pytest.mark.parametrize("auth", [False, True])
def test_json_nested_2000_deep_is_a_4xx_before_and_after_authentication(client: TestClient, key: str,
                                                                        auth: bool) -> None:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if auth else {})}
    response = client.post("/v1/jobs", content=deep_json(DEEP), headers=headers)
    assert 400 <= response.status_code < 500, response.text
    assert "deep" in response.text


def test_a_multipart_json_field_nested_2000_deep_is_a_422_naming_it(client: TestClient, key: str) -> None:
    response = client.post("/v1/jobs/multipart", headers={"authorization": f"Bearer {key}"},
                           data={"pipeline": "text-to-text", "input": "[" * DEEP + "]" * DEEP}, files={"x": b""})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "input"]


@pytest.mark.parametrize("cursor", ["²", "١٢", "-1", "x"])
def test_a_job_list_cursor_that_is_not_an_offset_is_a_422(client: TestClient, key: str, cursor: str) -> None:
    response = client.get("/v1/jobs", params={"cursor": cursor}, headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["query", "cursor"]
    assert client.get("/v1/jobs", params={"cursor": "0"}, headers={"authorization": f"Bearer {key}"}).status_code == 200


def test_the_consoles_page_size_and_cursor_take_only_ascii_digits(client: TestClient, key: str) -> None:
    token = CSRF.search(client.get("/ui/login").text)
    assert token
    signed = client.post("/ui/login", data={"api_key": key, "csrf_token": token.group(1), "next": "/ui/jobs"})
    assert signed.status_code == 303
    for query in ({"limit": "²"}, {"limit": "²²"}, {"cursor": "²"}):
        response = client.get("/ui/jobs", params=query)
        assert response.status_code == 200, (query, response.status_code)  # an unknown value shows every job
        with client.stream("GET", "/ui/jobs/stream", params=query) as stream:
            assert stream.status_code == 200, query


def test_retry_after_in_other_digits_is_unreadable_not_a_crash() -> None:
    for value in ("²", "١٢٠", "1²", "𝟗"):
        assert parse_retry_after(value) is None
    assert parse_retry_after("120") == 120.0


def test_a_receivers_retry_after_of_superscript_two_is_a_retry_with_backoff(redis_client: redis.Redis) -> None:
    store = RedisJobStore(redis_client, ttl_s=3600)
    policy = RetryPolicy(base_s=0.1, max_delay_s=2, max_attempts=3)
    ledger = JobLedger(store, webhook_progress_interval_s=30, webhook_attempts=policy.attempts_for)
    with WebhookReceiver() as receiver:
        url = receiver.script("/hook", [Answer(429, {"Retry-After": "²"})])
        job, _ = ledger.submit(Job(id=new_job_id(), pipeline="p", input={"prompt": "x"},
                                   stages=[StageRecord(id="ar", engine="ar", queue="ar")],
                                   webhook=JobWebhook(url=url, events=["completed"])), ["ar"])
        ledger.cancel(job.id)
        (mid,) = store.webhook_slots(job.id)
        deliverer = WebhookDeliverer(ledger=ledger, render=lambda j: j.model_dump(mode="json"),
                                     signer=WebhookSigner.from_setting(generate_secret()), policy=policy,
                                     timeout_s=5)
        outcome = deliverer.run(DeliverWebhook(job.id, mid, "completed", 1), worker="wh", owner="wh#1")
    assert (outcome.status, outcome.detail) == ("retry", "HTTP 429 Too Many Requests")
    hook = ledger.require(job.id).webhook
    assert hook is not None and [(d.attempt, d.status_code) for d in hook.deliveries] == [(1, 429)]
    assert store.webhook_slots(job.id)[mid].attempts == 1
