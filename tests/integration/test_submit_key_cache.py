"""POST /v1/jobs checks its API key from a short cache and again in the submit's own write: a
revoked key's next submit is refused at once, a replay included (real app, real Redis)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from omni_jobs.accept.auth import ApiKeys
from omni_jobs.core.settings import Settings

pytestmark = pytest.mark.integration

BODY = {"pipeline": "text-to-text", "input": {"prompt": "hello"}}


@pytest.fixture
def app_client(redis_url: str, tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(redis_url=redis_url, artifacts_dir=tmp_path / "artifacts", models_dir=tmp_path / "models")
    with TestClient(create_app(settings)) as client:
        yield client


def test_a_revoked_keys_next_submit_is_refused_though_the_key_was_cached(
        app_client: TestClient, redis_client: redis.Redis) -> None:
    key, info = ApiKeys(redis_client).create("acme")
    auth = {"authorization": f"Bearer {key}"}
    first = app_client.post("/v1/jobs", json=BODY, headers={**auth, "idempotency-key": "k1"})
    assert first.status_code == 202 and first.json()["tenant"] == "acme"
    assert app_client.post("/v1/jobs", json=BODY, headers=auth).status_code == 202  # from the cache
    jobs_before = app_client.get("/v1/jobs", headers=auth).json()["data"]
    ApiKeys(redis_client).revoke(info.id)
    refused = app_client.post("/v1/jobs", json=BODY, headers=auth)
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
    replay = app_client.post("/v1/jobs", json=BODY, headers={**auth, "idempotency-key": "k1"})
    assert replay.status_code == 401
    other, _ = ApiKeys(redis_client).create("acme")
    after = app_client.get("/v1/jobs", headers={"authorization": f"Bearer {other}"}).json()["data"]
    assert len(after) == len(jobs_before) == 2  # the refused submits wrote nothing


def test_a_wrong_secret_for_a_cached_key_id_is_refused(app_client: TestClient, redis_client: redis.Redis) -> None:
    key, _ = ApiKeys(redis_client).create("acme")
    assert app_client.post("/v1/jobs", json=BODY, headers={"authorization": f"Bearer {key}"}).status_code == 202
    forged = key[:-1] + ("A" if key[-1] != "A" else "B")
    assert app_client.post("/v1/jobs", json=BODY, headers={"authorization": f"Bearer {forged}"}).status_code == 401


def test_the_submit_headers_keep_their_limits_and_meaning(app_client: TestClient, redis_client: redis.Redis) -> None:
    key, _ = ApiKeys(redis_client).create("acme")
    auth = {"authorization": f"Bearer {key}"}
    too_long = app_client.post("/v1/jobs", json=BODY, headers={**auth, "idempotency-key": "k" * 256})
    assert too_long.status_code == 422
    assert too_long.json()["detail"][0]["loc"] == ["header", "idempotency-key"]
    assert app_client.post("/v1/jobs", json=BODY, headers={**auth, "cancel-after": "1" * 33}).status_code == 422
    bad = app_client.post("/v1/jobs", json=BODY, headers={**auth, "cancel-after": "soon"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["header", "Cancel-After"]
    timed = app_client.post("/v1/jobs", json=BODY, headers={**auth, "cancel-after": "5m", "idempotency-key": "k" * 255})
    assert timed.status_code == 202 and timed.json()["deadline_at"] is not None
    again = app_client.post("/v1/jobs", json=BODY, headers={**auth, "cancel-after": "5m", "idempotency-key": "k" * 255})
    assert again.headers["idempotent-replayed"] == "true" and again.json()["id"] == timed.json()["id"]


def test_a_keyed_submit_is_one_round_trip_and_its_replay_finds_the_job(
        app_client: TestClient, redis_client: redis.Redis) -> None:
    """An Idempotency-Key costs no read before the write: the write's own guard finds a replay."""
    key, _ = ApiKeys(redis_client).create("acme")
    app_client.post("/v1/jobs", json=BODY, headers={"authorization": f"Bearer {key}"})  # the key is cached now

    def hgetalls() -> int:
        return int(redis_client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0))

    # Redis counts every client's HGETALLs: the app's outbox relay reads the worker registry with one
    # about once a second, and may land in a submit's few milliseconds. A submit that read its key's
    # record would add one every time; so of three keyed submits, one at least adds none.
    reads = []
    for attempt in range(3):
        auth = {"authorization": f"Bearer {key}", "idempotency-key": f"one-trip-{attempt}"}
        before = hgetalls()
        first = app_client.post("/v1/jobs", json=BODY, headers=auth)
        assert first.status_code == 202
        reads.append(hgetalls() - before)
        if reads[-1] == 0:
            break
    assert reads[-1] == 0, f"HGETALLs during each keyed submit: {reads}"  # the record was not read: one write
    replay = app_client.post("/v1/jobs", json=BODY, headers=auth)
    assert replay.status_code == 202 and replay.json()["id"] == first.json()["id"]
    assert replay.headers["idempotent-replayed"] == "true"
    other = app_client.post("/v1/jobs", json={**BODY, "input": {"prompt": "else"}}, headers=auth)
    assert other.status_code == 409
