"""A 202 on disk with WAITAOF (OMNI_REDIS_WAIT_AOF): Redis fsyncs every second, and only a submit
waits for its own fsync. Real servers: a WAITAOF-capable one (Valkey, or Redis >= 7.2) with AOF
`everysec`, and the session's Redis 7.0 without AOF for the errors a wrong setup must name."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from omni_jobs.core import keys
from omni_jobs.core.errors import NotDurable
from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.checks import check_redis
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import Job, JobStatus, StageRecord
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.local.devservices import (
    VALKEY_INSTALL_HINT,
    WAITAOF_HZ,
    RunningService,
    find_waitaof_server,
    server_version,
    start_redis,
)
from omni_jobs.local.embedded import start_job_redis

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def waitaof_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    binary = find_waitaof_server()
    if binary is None:
        message = f"no server with WAITAOF (Redis >= 7.2 or Valkey) is installed: {VALKEY_INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(message)  # scripts/bootstrap installs one: CI must run these tests
        pytest.skip(message)
    with start_redis(data_dir=tmp_path_factory.mktemp("waitaof"), appendonly=True, appendfsync="everysec",
                     binary=binary, waitaof=True) as service:
        yield service


@pytest.fixture
def client(waitaof_server: RunningService) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(waitaof_server.url)
    c.config_resetstat()
    try:
        yield c
    finally:
        c.flushdb()
        c.close()


def waitaof_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_waitaof", {}).get("calls", 0))


def new_job() -> Job:
    return Job(id="job_" + uuid.uuid4().hex[:24], pipeline="text-to-text", input={"prompt": "x"},
               stages=[StageRecord(id="ar", engine="ar", queue="ar")])


def test_only_a_submit_waits_for_the_disk(client: redis.Redis, waitaof_server: RunningService) -> None:
    ledger = JobLedger(RedisJobStore(client, ttl_s=3600, wait_aof=True))
    job = new_job()
    ledger.submit(job, ["ar"])
    assert waitaof_calls(client) == 1
    aof = b"".join(p.read_bytes() for p in Path(waitaof_server.log_path).parent.rglob("*.aof*") if p.is_file())
    assert job.id.encode() in aof  # written (and fsynced: WAITAOF answered numlocal 1) before submit returned
    ledger.cancel(job.id)  # any other change answers at once
    stored = ledger.get(job.id)
    assert stored is not None and stored.status is JobStatus.canceled
    assert waitaof_calls(client) == 1


def test_the_api_answers_202_after_the_fsync(client: redis.Redis, waitaof_server: RunningService,
                                             tmp_path: Path) -> None:
    settings = Settings(redis_url=waitaof_server.url, redis_wait_aof=True, auth_enabled=False,
                        artifacts_dir=tmp_path / "artifacts", models_dir=tmp_path / "models")
    with TestClient(create_app(settings)) as api:
        body = {"pipeline": "text-to-text", "input": {"prompt": "hello"}}
        assert api.post("/v1/jobs", json=body).status_code == 202  # loads the script (a NOSCRIPT, then again)
        before = waitaof_calls(client)
        accepted = api.post("/v1/jobs", json=body)
        assert accepted.status_code == 202, accepted.text
        assert waitaof_calls(client) == before + 1  # the API's own (async) submit path
        assert api.get(f"/v1/jobs/{accepted.json()['id']}").json()["status"] == "queued"
        ready = api.get("/readyz").json()
    assert ready["redis"] == "ok"
    assert server_version(find_waitaof_server() or "") >= (7, 2)


def test_a_server_without_waitaof_is_named_with_the_fix(redis_client: redis.Redis, redis_url: str,
                                                         tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The session's Redis (7.0 or later, AOF off) cannot WAITAOF: doctor and /readyz say so and name
    the setting; a submit answers 503 and the API's log names the setting (its job was written, so a
    retry with its key finds it)."""
    check = check_redis(redis_client, url=redis_url, wait_aof=True)
    assert not check.ok
    assert "cannot WAITAOF" in check.detail and "OMNI_REDIS_WAIT_AOF" in check.fix
    with pytest.raises(NotDurable, match="OMNI_REDIS_WAIT_AOF"):
        JobLedger(RedisJobStore(redis_client, ttl_s=3600, wait_aof=True)).submit(new_job(), ["ar"])
    settings = Settings(redis_url=redis_url, redis_wait_aof=True, auth_enabled=False,
                        artifacts_dir=tmp_path / "artifacts", models_dir=tmp_path / "models",
                        metrics_token="scrape")  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as api:
        refused = api.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "hello"}})
        assert refused.status_code == 503, refused.text
        assert any("OMNI_REDIS_WAIT_AOF" in r.getMessage() for r in caplog.records)
        ready = api.get("/readyz", headers={"authorization": "Bearer scrape"})  # the details: to the token
    assert ready.status_code == 503
    assert "cannot WAITAOF" in ready.json()["redis"]


def test_waitaof_without_aof_is_named(tmp_path: Path, waitaof_server: RunningService) -> None:
    binary = find_waitaof_server()
    assert binary is not None
    with start_redis(data_dir=tmp_path / "no-aof", appendonly=False, binary=binary) as service:
        c = redis.Redis.from_url(service.url)
        check = check_redis(c, url=service.url, wait_aof=True)
        c.close()
    assert not check.ok
    assert "appendonly" in check.detail.lower()


def test_a_submit_waits_for_a_replica_and_is_refused_without_one(tmp_path: Path) -> None:
    """OMNI_REDIS_WAIT_REPLICAS=1 (WAIT, in its own round trip after the write): 202 once the replica
    has the job; with the replica gone, NotDurable (the API's 503) after the timeout."""
    with start_redis(data_dir=tmp_path / "primary") as primary, \
            start_redis(data_dir=tmp_path / "replica", replica_of=primary.port) as replica:
        client = redis.Redis.from_url(primary.url)
        deadline = time.monotonic() + 20
        while client.info("replication").get("slave0", {}).get("state") != "online":
            assert time.monotonic() < deadline, "the replica did not come online"
            time.sleep(0.05)
        ledger = JobLedger(RedisJobStore(client, ttl_s=3600, wait_replicas=1, wait_timeout_ms=300))
        job = new_job()
        ledger.submit(job, ["ar"])
        on_replica = redis.Redis.from_url(replica.url)
        assert on_replica.exists(keys.job(job.id)) == 1  # WAIT answered: the replica has it
        on_replica.close()
        replica.stop()
        with pytest.raises(NotDurable, match="0 of 1 replica"):
            ledger.submit(new_job(), ["ar"])
        client.close()


def test_omni_jobs_ups_redis_ticks_faster_only_where_submits_wait_with_waitaof(
        tmp_path: Path, waitaof_server: RunningService) -> None:
    """A WAITAOF wait ends when the server's main thread next wakes; with every client waiting, that is
    its timer tick (docs/reliability.md). `omni-jobs up` runs a WAITAOF server at WAITAOF_HZ, and an
    `always` one at the server's default."""
    service, mode = start_job_redis(tmp_path / "waitaof", "waitaof")
    with service:
        client = redis.Redis.from_url(service.url)
        assert mode == "waitaof" and client.config_get("hz") == {"hz": str(WAITAOF_HZ)}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        client.close()
    service, mode = start_job_redis(tmp_path / "always", "always")
    with service:
        client = redis.Redis.from_url(service.url)
        assert mode == "always" and client.config_get("hz") == {"hz": "10"}
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        client.close()
