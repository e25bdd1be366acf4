"""A submit that applied but whose answer did not come back (issue 62): the API answers the job it made.

- Redis's reply to the submit's script is lost (the connection cut right after the request): redis-py
  sends the same script again, whose job-id guard finds the job it made. That was a 500, with the job
  running anyway.
- The write applied but did not reach the disk or a replica in time (WAITAOF / WAIT): still a 503,
  but naming the job that was made, so that a client follows it instead of submitting it twice.

Real servers: the session's redis-server, reached through a loopback proxy that cuts connections.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from omni_jobs.accept.auth import ApiKeys
from omni_jobs.core import keys
from omni_jobs.core.errors import NotDurable
from omni_jobs.core.settings import Settings
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import Job, StageRecord, new_job_id
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.local.devservices import RunningService
from tests.tcp_proxy import ReplyCutter

pytestmark = pytest.mark.integration

BODY = {"pipeline": "text-to-text", "input": {"prompt": "answer me"}}


@pytest.fixture
def key(redis_client: redis.Redis) -> str:
    return ApiKeys(redis_client).create("acme", "reply-lost")[0]


def tenant_jobs(redis_client: redis.Redis) -> list[str]:
    return [m.decode() for m in redis_client.zrange(keys.tenant_jobs("acme"), 0, -1)]


@pytest.mark.parametrize("idempotency_key", [None, "lost-reply-1"])
def test_a_submit_whose_reply_was_lost_is_answered_the_job_it_made(
        redis_service: RunningService, redis_client: redis.Redis, key: str, tmp_path: Path,
        idempotency_key: str | None) -> None:
    with ReplyCutter(redis_service.port) as proxy:
        settings = Settings(redis_url=f"redis://127.0.0.1:{proxy.port}/0", artifacts_dir=tmp_path / "a",
                            models_dir=tmp_path / "m")
        with TestClient(create_app(settings), raise_server_exceptions=False) as api:
            headers = {"authorization": f"Bearer {key}",
                       **({"idempotency-key": idempotency_key} if idempotency_key else {})}
            assert api.post("/v1/jobs", json=BODY, headers=headers | {"idempotency-key": "warm-up"}).status_code == 202
            proxy.arm(rb"EVALSHA")
            answer = api.post("/v1/jobs", json=BODY, headers=headers)
            assert proxy.cut_reply.is_set(), "the proxy cut no reply"
            assert answer.status_code == 202, answer.text
            made = answer.json()["id"]
            assert "idempotent-replayed" not in answer.headers  # this very request made it
    assert made in tenant_jobs(redis_client) and len(tenant_jobs(redis_client)) == 2  # the warm-up's and this one


def test_the_ledger_answers_its_own_job_when_the_same_write_is_sent_twice(redis_client: redis.Redis) -> None:
    """The sync path too (the in-process Omni, the CLI): the same job's submit again is no error."""
    ledger = JobLedger(RedisJobStore(redis_client, ttl_s=3600))
    job = Job(id=new_job_id(), pipeline="p", input={"prompt": "x"}, stages=[StageRecord(id="ar", engine="ar",
                                                                                        queue="ar")])
    first, created = ledger.submit(job.model_copy(deep=True), ["ar"])
    again, created_again = ledger.submit(job.model_copy(deep=True), ["ar"])
    assert created and created_again and again.id == first.id
    assert redis_client.zcard(keys.queue_waiting("ar")) == 1  # one job, queued once


@pytest.mark.parametrize("wait", ["replicas", "aof"])
def test_a_write_not_durable_in_time_answers_503_naming_the_job_it_made(
        redis_url: str, redis_client: redis.Redis, key: str, tmp_path: Path, wait: str) -> None:
    """The session's Redis has no replica (WAIT 1 times out) and no AOF (WAITAOF is refused): the write
    applied, so the answer names the job, with its URL, as the message says to retry with its key."""
    durable = {"redis_wait_replicas": 1} if wait == "replicas" else {"redis_wait_aof": True}
    settings = Settings(redis_url=redis_url, redis_wait_timeout_ms=200, artifacts_dir=tmp_path / "a",
                        models_dir=tmp_path / "m", **durable)  # type: ignore[arg-type]
    with TestClient(create_app(settings), raise_server_exceptions=False) as api:
        answer = api.post("/v1/jobs", json=BODY, headers={"authorization": f"Bearer {key}",
                                                          "idempotency-key": f"not-durable-{wait}"})
        assert answer.status_code == 503, answer.text
        body = answer.json()
        (made,) = tenant_jobs(redis_client)
        assert body["job"]["id"] == made and answer.headers["location"] == f"/v1/jobs/{made}"
        assert made in body["detail"] and "Idempotency-Key" in body["detail"] and answer.headers["retry-after"]
        again = api.post("/v1/jobs", json=BODY, headers={"authorization": f"Bearer {key}",
                                                         "idempotency-key": f"not-durable-{wait}"})
        assert again.status_code == 202 and again.json()["id"] == made  # the retry with its key: that job
    with pytest.raises(NotDurable) as caught:  # the core says which job, for every caller
        JobLedger(RedisJobStore(redis_client, ttl_s=3600, wait_replicas=1, wait_timeout_ms=100)).submit(
            Job(id=new_job_id(), pipeline="p", input={}, stages=[StageRecord(id="ar", engine="ar", queue="ar")]),
            ["ar"])
    assert caught.value.job_id is not None and caught.value.job_id in str(caught.value)
