"""/readyz and the queue metrics of an API with real Redis and no workers (the e2e tests cover the
ready system): what is missing is named with its fix, and a job waiting on its queue is counted,
first in the job store (written with the job) and then in the broker (once the relay published it)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from api.main import create_app
from omni_jobs.accept.auth import ApiKeys
from omni_jobs.core import keys
from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.worker_registry import register_worker, unregister_worker
from omni_jobs.local.devservices import RunningService, free_port

READINESS_DB = 7
TOKEN = "readiness-scrape-token"
SCRAPE = {"authorization": f"Bearer {TOKEN}"}
"""OMNI_METRICS_TOKEN: /readyz shows its details (worker names, addresses) only to it; /metrics needs it."""


@pytest.fixture
def settings(redis_service: RunningService, tmp_path: Path) -> Iterator[Settings]:
    url = f"redis://127.0.0.1:{redis_service.port}/{READINESS_DB}"
    yield Settings(redis_url=url, artifacts_dir=tmp_path / "artifacts", models_dir=tmp_path / "models",
                   metrics_token=SecretStr(TOKEN))
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()


def metric(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def test_not_ready_without_workers_names_each_queue_and_the_command(settings: Settings) -> None:
    with TestClient(create_app(settings)) as client:
        catalogue = client.app.state.ctx.runtime.catalogue  # type: ignore[attr-defined]
        needed = {s.queue_name for spec in catalogue for s in spec.stages} | {"results"}
        response = client.get("/readyz", headers=SCRAPE)
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
        body = response.json()
        assert body["status"] == "unavailable" and body["redis"] == "ok" and body["artifact_store"] == "ok"
        assert body["workers"] == {q: [] for q in needed}
        for queue in needed:
            pool = "solo -c 1" if queue == "results" else "threads -c 16"
            assert (f"workers/{queue}: no live worker -> start one: celery -A workers.app:app worker -Q {queue} "
                    f"-P {pool} -n {queue}@%h") in body["missing"]
        assert client.get("/healthz").json() == {"status": "ok"}  # alive, just not ready

        # Every queue but one gets a worker heartbeat (as a worker writes it): only that one is missing.
        r = client.app.state.ctx.runtime.redis  # type: ignore[attr-defined]
        for queue in needed - {"dit"}:
            register_worker(r, f"{queue}@test", [queue])
        body = client.get("/readyz", headers=SCRAPE).json()
        assert [m.split(":")[0] for m in body["missing"]] == ["workers/dit"]
        register_worker(r, "dit@test", ["dit"])
        ready = client.get("/readyz", headers=SCRAPE)
        assert ready.status_code == 200 and ready.json()["missing"] == []
        assert ready.json()["workers"]["dit"] == ["dit@test"]
        unregister_worker(r, "dit@test")
        assert client.get("/readyz", headers=SCRAPE).status_code == 503
        # A deployment that scales stage workers to zero asks without them (its readiness probe).
        scaled_to_zero = client.get("/readyz", params={"workers": "false"}, headers=SCRAPE)
        assert scaled_to_zero.status_code == 200 and scaled_to_zero.json()["missing"] == []
        assert scaled_to_zero.json()["workers"]["dit"] == []  # still shown


def test_without_workers_readiness_still_needs_the_services(settings: Settings) -> None:
    s3 = settings.model_copy(update={"artifact_backend": "s3", "s3_endpoint_url": f"http://127.0.0.1:{free_port()}",
                                     "s3_access_key_id": "testing", "s3_secret_access_key": "testing"})
    with TestClient(create_app(s3)) as client:
        response = client.get("/readyz", params={"workers": "false"}, headers=SCRAPE)
        assert response.status_code == 503
        assert [m.split(":")[0] for m in response.json()["missing"]] == ["services/artifact store"]


def test_unreachable_artifact_store_is_not_ready(settings: Settings) -> None:
    s3 = settings.model_copy(update={"artifact_backend": "s3", "s3_endpoint_url": f"http://127.0.0.1:{free_port()}",
                                     "s3_access_key_id": "testing", "s3_secret_access_key": "testing"})
    with TestClient(create_app(s3)) as client:
        body = client.get("/readyz", headers=SCRAPE).json()
        assert body["status"] == "unavailable" and body["redis"] == "ok"
        assert "unreachable" in body["artifact_store"]
        (store,) = [m for m in body["missing"] if m.startswith("services/artifact store")]
        assert "s3 bucket omni-jobs at http://127.0.0.1:" in store and "OMNI_S3_ENDPOINT_URL" in store


def test_a_job_waiting_for_a_worker_shows_in_queue_depth(settings: Settings) -> None:
    with TestClient(create_app(settings)) as client:
        before = client.get("/metrics", headers=SCRAPE).text
        assert metric(before, "omni_jobs_queue_depth", queue="ar") == 0
        assert metric(before, "omni_jobs_queue_workers", queue="ar") == 0
        key = ApiKeys(redis.Redis.from_url(settings.redis_url)).create("readiness")[0]
        accepted = client.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "hi"}},
                               headers={"authorization": f"Bearer {key}"})
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["id"]
        # The step is waiting on its queue from the moment the job is accepted: same write as the job.
        now_ = client.get("/metrics", headers=SCRAPE)
        assert now_.headers["content-type"].startswith("text/plain")
        assert metric(now_.text, "omni_jobs_queue_waiting", queue="ar") == 1
        assert metric(now_.text, "omni_jobs_queue_running", queue="ar") == 0
        # No worker listens: the scheduler keeps it (a queue's window is its live workers' concurrency).
        time.sleep(1.5)
        held = client.get("/metrics", headers=SCRAPE).text
        assert metric(held, "omni_jobs_queue_depth", queue="ar") == 0
        assert metric(held, "omni_jobs_queue_ready", queue="ar", tenant="readiness") == 1
        # A worker appears (its heartbeat): the API's relay releases and publishes the step without being
        # asked: then it is one Celery message, not yet taken.
        register_worker(redis.Redis.from_url(settings.redis_url), "ar@elsewhere", ["ar"], concurrency=4)
        deadline = time.monotonic() + 10
        after = now_.text
        while metric(after, "omni_jobs_queue_depth", queue="ar") != 1:
            assert time.monotonic() < deadline, "the relay did not publish the accepted job's first step"
            time.sleep(0.05)
            after = client.get("/metrics", headers=SCRAPE).text
        assert metric(after, "omni_jobs_queue_depth", queue="dit") == 0
        assert metric(after, "omni_jobs_queue_waiting", queue="ar") == 1  # published, still not started
        broker = redis.Redis.from_url(settings.redis_url)
        (raw,) = broker.lrange("ar", 0, -1)
        headers = json.loads(raw)["headers"]
        assert (headers["task"], headers["id"]) == ("omni.run_stage", f"stage:{job_id}:ar:1")  # task id = outbox id
        assert broker.zcard(keys.OUTBOX) == 0  # published entries leave the outbox
        assert metric(client.get("/metrics", headers=SCRAPE).text, "omni_jobs_queue_released", queue="ar") == 1
        broker.close()
        queued = metric(after, "omni_jobs_jobs_total", pipeline="text-to-text", status="queued")
        assert queued is not None and queued >= 1
        assert metric(after, "omni_jobs_http_requests_total", method="POST", route="/v1/jobs",
                      status="202") is not None
        # The request id comes back on every answer, as given or made up.
        assert client.get("/healthz", headers={"x-request-id": "req-42"}).headers["x-request-id"] == "req-42"


def test_doctor_names_each_workers_cpus_where_it_has_its_own(settings: Settings) -> None:
    """`omni-jobs up --engine-workers 2`'s workers heartbeat their OMNI_ENGINE_CPUS; doctor shows them."""
    from omni_jobs.dispatch.checks import check_workers

    client = redis.Redis.from_url(settings.redis_url)
    register_worker(client, "dit@h", ["dit"], 32, cpus="0")
    register_worker(client, "dit-2@h", ["dit"], 32, cpus="1")
    register_worker(client, "ar@h", ["ar"], 16)  # every CPU: nothing to say
    by_queue = {c.name: c for c in check_workers(client, ["ar", "dit", "results"])}
    assert by_queue["dit"].ok and by_queue["dit"].detail == "dit-2@h (CPUs 1), dit@h (CPUs 0)"
    assert by_queue["ar"].detail == "ar@h"
    assert not by_queue["results"].ok
    client.close()
