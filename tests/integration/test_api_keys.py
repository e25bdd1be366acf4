"""API keys in real Redis, and the API's authentication, tenancy and limits through the real app
(TestClient over create_app with real Redis; no workers are needed: jobs only wait on their queue)."""

from __future__ import annotations

import base64
import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from PIL import Image
from standardwebhooks.webhooks import Webhook

from api.main import create_app
from omni_jobs.accept.auth import ApiKeys, InvalidApiKey, hash_key
from omni_jobs.core import keys
from omni_jobs.core.net_guard import NetGuard
from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.scheduling import Scheduler
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import Job, JobWebhook, StageRecord, now
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import DeliverWebhook
from omni_jobs.report.webhooks import RetryPolicy, WebhookDeliverer, WebhookSigner, generate_secret
from tests.webhook_receiver import WebhookReceiver


@pytest.fixture
def settings(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, artifacts_dir=tmp_path / "artifacts", models_dir=tmp_path / "models",
                    webhook_secret=generate_secret(), max_steps=50, max_request_bytes=256 * 1024,  # type: ignore[arg-type]
                    max_image_pixels=64 * 64)


@pytest.fixture
def app_client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_keys_are_stored_hashed_and_verify_until_revoked(redis_client: redis.Redis) -> None:
    store = ApiKeys(redis_client)
    key, info = store.create("acme", "ci")
    assert key.startswith(f"ok_{info.id}_") and len(key) > 50
    record = {k.decode(): v.decode() for k, v in redis_client.hgetall(keys.api_key(info.id)).items()}  # type: ignore[union-attr]
    assert record["hash"] == hash_key(key) and record["tenant"] == "acme" and record["revoked"] == "0"
    dump = b"".join(redis_client.dump(k) or b"" for k in redis_client.keys("*"))  # everything Redis holds
    assert key.encode() not in dump and key.split("_", 2)[2].encode() not in dump
    assert store.verify(key).tenant == "acme"
    with pytest.raises(InvalidApiKey):
        store.verify(key[:-1] + ("A" if key[-1] != "A" else "B"))  # same id, wrong secret
    assert [(i.id, i.tenant, i.name, i.revoked) for i in store.list()] == [(info.id, "acme", "ci", False)]
    assert store.revoke(info.id).revoked is True
    with pytest.raises(InvalidApiKey):
        store.verify(key)
    assert store.list()[0].revoked is True
    with pytest.raises(KeyError):
        store.revoke("0000000000000000")


def test_requests_without_a_valid_key_are_401_and_open_routes_stay_open(
        app_client: TestClient, redis_client: redis.Redis) -> None:
    key, info = ApiKeys(redis_client).create("acme")
    for headers in ({}, bearer("ok_nope"), bearer("ok_0123456789abcdef_" + "x" * 43), {"authorization": f"Basic {key}"}):
        for method, path in (("GET", "/v1/jobs"), ("GET", "/v1/pipelines"), ("GET", "/v1/jobs/job_1"),
                             ("POST", "/v1/jobs/job_1/cancel"), ("GET", "/v1/jobs/job_1/events"),
                             ("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            response = app_client.request(method, path, headers=headers)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert response.headers["www-authenticate"].startswith("Bearer")
    assert app_client.get("/v1/pipelines", headers=bearer(key)).status_code == 200
    assert app_client.get("/healthz").status_code == 200
    assert app_client.get("/openapi.json").status_code == 200 and app_client.get("/docs").status_code == 200
    assert app_client.get("/metrics").status_code == 200
    ApiKeys(redis_client).revoke(info.id)
    assert app_client.get("/v1/pipelines", headers=bearer(key)).status_code == 401


def test_each_tenant_sees_only_its_own_jobs(app_client: TestClient, redis_client: redis.Redis) -> None:
    a, _ = ApiKeys(redis_client).create("tenant-a")
    b, _ = ApiKeys(redis_client).create("tenant-b")
    body = {"pipeline": "text-to-text", "input": {"prompt": "mine"}}
    job = app_client.post("/v1/jobs", json=body, headers=bearer(a)).json()
    assert job["tenant"] == "tenant-a"
    assert app_client.get(f"/v1/jobs/{job['id']}", headers=bearer(a)).status_code == 200
    for method, path in (("GET", f"/v1/jobs/{job['id']}"), ("POST", f"/v1/jobs/{job['id']}/cancel"),
                         ("GET", f"/v1/jobs/{job['id']}/events"), ("GET", f"/v1/jobs/{job['id']}/outputs/text")):
        other = app_client.request(method, path, headers=bearer(b))
        unknown = app_client.request(method, path.replace(job["id"], "job_000000000000000000000000"), headers=bearer(b))
        assert other.status_code == unknown.status_code == 404, (method, path, other.text)
    assert [j["id"] for j in app_client.get("/v1/jobs", headers=bearer(a)).json()["data"]] == [job["id"]]
    assert app_client.get("/v1/jobs", headers=bearer(b)).json()["data"] == []
    # The same Idempotency-Key in two tenants makes two jobs, never hands one tenant the other's.
    first = app_client.post("/v1/jobs", json=body, headers={**bearer(a), "idempotency-key": "k1"}).json()
    second = app_client.post("/v1/jobs", json=body, headers={**bearer(b), "idempotency-key": "k1"})
    assert second.status_code == 202 and second.json()["id"] != first["id"]
    assert second.json()["tenant"] == "tenant-b"
    # b cannot cancel a's job; a still can.
    assert app_client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(a)).json()["status"] == "canceled"


def test_input_limits_answer_clear_4xx(app_client: TestClient, redis_client: redis.Redis) -> None:
    key, _ = ApiKeys(redis_client).create("acme")
    h = bearer(key)
    steps = app_client.post("/v1/jobs", headers=h, json={"pipeline": "text-to-image", "input": {"prompt": "x"},
                                                         "params": {"dit": {"num_inference_steps": 51}}})
    assert steps.status_code == 422
    assert any(d["loc"] == ["body", "params", "dit", "num_inference_steps"] and "OMNI_MAX_STEPS" in d["msg"]
               for d in steps.json()["detail"])
    big = app_client.post("/v1/jobs", headers={**h, "content-type": "application/json"},
                          content=json.dumps({"pipeline": "text-to-text", "input": {"prompt": "x" * 300_000}}))
    assert big.status_code == 413 and "OMNI_MAX_REQUEST_BYTES" in big.json()["detail"]
    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it is read
        yield b'{"pipeline": "text-to-text", "input": {"prompt": "'
        for _ in range(40):
            yield b"x" * 10_000
        yield b'"}}'

    chunked = app_client.post("/v1/jobs", headers={**h, "content-type": "application/json"}, content=chunks())
    assert chunked.status_code == 413, chunked.text
    extra = app_client.post("/v1/jobs", headers=h, json={"pipeline": "text-to-text", "input": {"prompt": "x"},
                                                         "owner": "someone-else"})
    assert extra.status_code == 422 and extra.json()["detail"][0]["loc"] == ["body", "owner"]
    buf = io.BytesIO()
    Image.new("RGB", (80, 80)).save(buf, format="PNG")
    image = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    too_big = app_client.post("/v1/jobs", headers=h, json={"pipeline": "image-to-image",
                                                           "input": {"prompt": "x", "image": image}})
    assert too_big.status_code == 422 and "80x80 pixels" in too_big.text, too_big.text
    n = app_client.post("/v1/images/generations", headers=h, json={"prompt": "x", "n": 11})
    assert n.status_code in (400, 422)


@pytest.mark.parametrize(("url", "fragment"), [
    ("http://example.com/hook", "https://"),
    ("https://127.0.0.1/hook", "127.0.0.1"),
    ("https://169.254.169.254/latest/meta-data", "169.254.169.254"),
    ("https://localhost:6379/", "OMNI_WEBHOOK_ALLOW_HOSTS"),
])
def test_webhooks_to_internal_addresses_are_refused_at_submit(
        app_client: TestClient, redis_client: redis.Redis, url: str, fragment: str) -> None:
    key, _ = ApiKeys(redis_client).create("acme")
    response = app_client.post("/v1/jobs", headers=bearer(key),
                               json={"pipeline": "text-to-text", "input": {"prompt": "x"}, "webhook": url})
    assert response.status_code == 422, response.text
    assert any(d["loc"] == ["body", "webhook"] and fragment in d["msg"] for d in response.json()["detail"])


def test_keys_cli_creates_lists_and_revokes(redis_url: str, redis_client: redis.Redis,
                                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from omni_jobs.cli import main
    from omni_jobs.core.settings import get_settings

    monkeypatch.setenv("OMNI_REDIS_URL", redis_url)
    get_settings.cache_clear()
    assert main(["keys", "create", "--tenant", "acme", "--name", "ci"]) == 0
    key = capsys.readouterr().out.strip()
    info = ApiKeys(redis_client).verify(key)
    assert info.tenant == "acme" and info.name == "ci"
    assert main(["keys", "list"]) == 0
    listed = capsys.readouterr().out
    assert info.id in listed and "active" in listed and key not in listed
    assert main(["keys", "revoke", info.id]) == 0
    assert main(["keys", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1])[0]["revoked"] is True
    assert main(["keys", "create", "--tenant", "bad tenant"]) == 2


# --- the webhook deliverer through the SSRF guard (real Redis job store, real loopback receiver) ---
def _guarded_deliverer(ledger: JobLedger, guard: NetGuard, secret: str) -> WebhookDeliverer:
    return WebhookDeliverer(ledger=ledger, render=lambda j: j.model_dump(mode="json"),
                            signer=WebhookSigner.from_setting(secret), policy=RetryPolicy(base_s=0.1, max_attempts=3),
                            timeout_s=5, guard=guard)


def _completed_message(ledger: JobLedger, url: str) -> tuple[Job, DeliverWebhook]:
    """A job with a ``completed`` webhook, canceled: the ledger queued the message's first delivery
    attempt in the outbox, which is taken here as the relay would."""
    job = Job(id="job_" + uuid.uuid4().hex[:24], pipeline="text-to-text", input={"prompt": "x"},
              stages=[StageRecord(id="ar", engine="ar", queue="ar")], webhook=JobWebhook(url=url, events=["completed"]))
    ledger.submit(job, ["ar"])
    ledger.cancel(job.id)
    Scheduler(ledger.store, None).release_all()  # first attempts wait for their turn
    entries = ledger.store.claim_outbox(now=now(), limit=10, hold_s=60.0, job_id=job.id)
    ledger.store.ack_outbox([e.id for e in entries])
    (step,) = [e.step for e in entries]
    assert isinstance(step, DeliverWebhook) and (step.event, step.attempt) == ("completed", 1)
    return job, step


def test_delivery_connects_to_the_checked_address_with_the_original_host(redis_client: redis.Redis) -> None:
    """'hooks.test' exists in no DNS: only the guard's pinned address can have reached the receiver."""
    ledger = JobLedger(RedisJobStore(redis_client, ttl_s=600))
    secret = generate_secret()
    with WebhookReceiver() as receiver:
        port = receiver.server.server_address[1]
        guard = NetGuard(allow_hosts=["hooks.test"], resolve=lambda host, _port: {"hooks.test": ["127.0.0.1"]}[host])
        job, step = _completed_message(ledger, f"http://hooks.test:{port}/hook")
        outcome = _guarded_deliverer(ledger, guard, secret).run(step, worker="wh", owner="wh#1")
        assert outcome.status == "delivered", ledger.require(job.id).webhook
        got = receiver.at("/hook")
        assert len(got) == 1 and got[0].headers["host"] == f"hooks.test:{port}"
        assert got[0].message_id == step.message_id
        assert Webhook(secret).verify(got[0].body, got[0].headers)["id"] == job.id
    assert ledger.store.webhook_slots(job.id)[step.message_id].status == "delivered"
    delivery = ledger.require(job.id).webhook.deliveries[0]  # type: ignore[union-attr]
    assert (delivery.id, delivery.attempt, delivery.status_code, delivery.error) == (step.message_id, 1, 200, None)


def test_a_host_that_rebinds_to_a_private_address_is_refused_at_delivery_and_not_retried(
        redis_client: redis.Redis) -> None:
    ledger = JobLedger(RedisJobStore(redis_client, ttl_s=600))
    table = {"hooks.example": ["93.184.216.34"]}
    guard = NetGuard(resolve=lambda host, _port: table[host])
    guard.check("https://hooks.example/hook")  # what submit saw
    job, step = _completed_message(ledger, "https://hooks.example/hook")
    with WebhookReceiver() as receiver:
        table["hooks.example"] = ["127.0.0.1"]  # rebinding: now it points inside
        outcome = _guarded_deliverer(ledger, guard, generate_secret()).run(step, worker="wh", owner="wh#1")
        assert outcome.status == "rejected" and "127.0.0.1" in outcome.detail
        assert receiver.at("/hook") == []
    # Final at the first attempt: no next attempt is queued, however many the policy allows.
    assert ledger.store.webhook_slots(job.id)[step.message_id].status == "rejected"
    Scheduler(ledger.store, None).release_all()  # first attempts wait for their turn
    assert ledger.store.claim_outbox(now=now() + 3600, limit=10, hold_s=60.0, job_id=job.id) == []
    delivery = ledger.require(job.id).webhook.deliveries[0]  # type: ignore[union-attr]
    assert delivery.status_code is None and "refused by the SSRF guard" in (delivery.error or "")
    assert "127.0.0.1" in (delivery.error or "")
