"""/metrics and /readyz without authentication name no tenant and no host (issue 62); OMNI_METRICS_TOKEN, a
scrape token, gets their details and, once set, is required for /metrics. Real app, real Redis, no workers."""

from __future__ import annotations

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
from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.worker_registry import register_worker
from omni_jobs.local.devservices import RunningService, free_port

pytestmark = pytest.mark.integration

DB = 8
TOKEN = "scrape-" + "x" * 32
TENANT = "acme-secret-customer"
HOST = "gpu-node-17.internal"


@pytest.fixture
def settings(redis_service: RunningService, tmp_path: Path) -> Iterator[Settings]:
    url = f"redis://127.0.0.1:{redis_service.port}/{DB}"
    yield Settings(redis_url=url, artifacts_dir=tmp_path / "artifacts", models_dir=tmp_path / "models",
                   artifact_backend="s3", s3_endpoint_url=f"http://{HOST}:{free_port()}", s3_access_key_id="testing",
                   s3_secret_access_key="testing")  # type: ignore[arg-type]
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()


def waiting_job_of_a_tenant(client: TestClient, settings: Settings) -> None:
    """A job of TENANT waits for its turn (no worker for its queue), and a worker runs on HOST."""
    state = redis.Redis.from_url(settings.redis_url)
    key = ApiKeys(state).create(TENANT)[0]
    accepted = client.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "hi"}},
                           headers={"authorization": f"Bearer {key}"})
    assert accepted.status_code == 202, accepted.text
    register_worker(state, f"dit@{HOST}", ["dit"])
    state.close()
    time.sleep(1.2)  # the relay's pass: the job waits in its tenant's ready list


def series(text: str, name: str) -> list[dict[str, str]]:
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def test_without_a_token_metrics_and_readiness_name_no_tenant_and_no_host(settings: Settings) -> None:
    with TestClient(create_app(settings)) as client:
        waiting_job_of_a_tenant(client, settings)
        metrics = client.get("/metrics")
        assert metrics.status_code == 200
        assert TENANT not in metrics.text and HOST not in metrics.text
        assert {"queue": "ar"} in series(metrics.text, "omni_jobs_queue_ready")  # still counted, per queue
        ready = client.get("/readyz")
        assert ready.status_code == 503  # the same verdict: probes keep working
        assert HOST not in ready.text and TENANT not in ready.text
        body = ready.json()
        assert body["workers"]["dit"] == 1 and body["workers"]["ar"] == 0  # how many, not who
        assert any(m.startswith("workers/ar: no live worker -> start one:") for m in body["missing"])
        assert any(m.startswith("services/artifact store") for m in body["missing"])


def test_the_scrape_token_is_required_for_metrics_and_shows_the_details(settings: Settings) -> None:
    with TestClient(create_app(settings.model_copy(update={"metrics_token": SecretStr(TOKEN)}))) as client:
        waiting_job_of_a_tenant(client, settings)
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {TOKEN}"}):
            refused = client.get("/metrics", headers=headers)
            assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
            assert "OMNI_METRICS_TOKEN" in refused.text
        scraped = client.get("/metrics", headers={"authorization": f"Bearer {TOKEN}"})
        assert scraped.status_code == 200
        assert {"queue": "ar", "tenant": TENANT} in series(scraped.text, "omni_jobs_queue_ready")
        assert {"tenant": TENANT, "status": "queued"} in series(scraped.text, "omni_jobs_tenant_jobs_total")
        plain = client.get("/readyz")  # a probe has no token: the verdict, without the details
        assert plain.status_code == 503 and HOST not in plain.text
        detailed = client.get("/readyz", headers={"authorization": f"Bearer {TOKEN}"})
        assert detailed.status_code == 503
        assert detailed.json()["workers"]["dit"] == [f"dit@{HOST}"] and HOST in detailed.json()["artifact_store"]
