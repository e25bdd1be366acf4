"""The whole system for end-to-end tests, started once per session as a user would run it.

Real processes: the session redis-server, a moto S3 endpoint, the API under uvicorn, one Celery
worker per queue (ar on vLLM, dit on diffusers, results) and Flower. Artifacts go to S3 except
small intermediates, which stay in Redis, so both paths are exercised by every job.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from omni_jobs.core.settings import Settings
from omni_jobs.local.devservices import RunningService, free_port
from omni_jobs.local.embedded import EmbeddedSystem
from omni_jobs.report.webhooks import generate_secret
from tests.e2e.job_contract import check_job_responses
from tests.media_files import MEDIA_PIPELINE

E2E_REDIS_DB = 3  # the integration tests flush DB 0 of the shared server; the system lives apart

# Two secrets, as during a rotation: every delivery carries a signature for each.
WEBHOOK_SECRETS = (generate_secret(), generate_secret())
# A short retry schedule (0.2, 0.4, 0.8 s nominal; 4 attempts) so that retry tests take seconds.
WEBHOOK_ENV = {
    "OMNI_WEBHOOK_SECRET": ",".join(WEBHOOK_SECRETS),
    "OMNI_WEBHOOK_RETRY_BASE_S": "0.2",
    "OMNI_WEBHOOK_MAX_ATTEMPTS": "4",
    "OMNI_WEBHOOK_TIMEOUT_S": "5",
    "OMNI_WEBHOOK_PROGRESS_INTERVAL_S": "0",
    "OMNI_MAX_PREFER_WAIT_S": "30",
    # The webhook tests' receivers listen on loopback over http: allowed by name, as an operator would.
    "OMNI_WEBHOOK_ALLOW_HOSTS": '["127.0.0.1"]',
}

S3_SECRET = "s3secret-" + secrets.token_hex(12)  # moto checks no signatures: any value works

DIT_ONLY_PIPELINE = {
    "name": "dit-only",
    "description": "One short DiT stage: many small jobs on one queue, for the scheduling tests.",
    "inputs": {"prompt": {"type": "text"}},
    "stages": [{"id": "dit", "engine": "dit", "model": "tiny:pixart", "inputs": {"prompt": "input.prompt"},
                "engine_args": {"pipeline_class": "PixArtSigmaPipeline"},
                "defaults": {"height": 32, "width": 32, "num_inference_steps": 2}}],
    "outputs": [{"name": "image", "from": "dit.image"}],
}
PRIORITY_AGING_S = 2.0
"""Short, so that the no-starvation bound is tested in seconds (the default is 300 s)."""

BROKEN_MODEL_PIPELINE = {
    "name": "broken-model",
    "description": "A user pipeline whose model path does not exist: its jobs must fail cleanly.",
    "inputs": {"prompt": {"type": "text"}},
    "stages": [{"id": "ar", "engine": "ar", "model": "/nonexistent/omni-model", "queue": "ar",
                "inputs": {"prompt": "input.prompt"}}],
    "outputs": [{"name": "text", "from": "ar.text"}],
}


def models_dir() -> Path:
    return (Path(__file__).resolve().parents[2] / "var" / "models").resolve()


@pytest.fixture(scope="session")
def system(
    tmp_path_factory: pytest.TempPathFactory, redis_service: RunningService, s3_endpoint_url: str
) -> Iterator[EmbeddedSystem]:
    home = tmp_path_factory.mktemp("system")
    pipelines = home / "pipelines"
    pipelines.mkdir()
    (pipelines / "broken-model.yaml").write_text(yaml.safe_dump(BROKEN_MODEL_PIPELINE))
    (pipelines / "dit-only.yaml").write_text(yaml.safe_dump(DIT_ONLY_PIPELINE))
    (pipelines / "media-inputs.yaml").write_text(yaml.safe_dump(MEDIA_PIPELINE))  # audio and video inputs
    redis_url = f"redis://127.0.0.1:{redis_service.port}/{E2E_REDIS_DB}"
    settings = Settings(models_dir=models_dir(), artifacts_dir=home / "artifacts", redis_url=redis_url)
    system = EmbeddedSystem(
        settings=settings,
        home=home,
        api_port=free_port(),
        flower_port=free_port(),
        redis_url=redis_url,
        extra_env={
            "OMNI_ARTIFACT_BACKEND": "s3",
            "OMNI_S3_ENDPOINT_URL": s3_endpoint_url,
            "OMNI_S3_BUCKET": "omni-e2e",
            "OMNI_S3_ACCESS_KEY_ID": "testing",
            "OMNI_S3_SECRET_ACCESS_KEY": S3_SECRET,  # unique, so test_tenancy can grep the logs for it
            "OMNI_REDIS_ARTIFACT_MAX_BYTES": "2048",
            "OMNI_PIPELINES_PATH": json.dumps([str(pipelines)]),
            # One job in flight per stage worker: these tests assert queue positions behind a busy
            # worker and same-seed byte equality across jobs (batch composition changes the last bit).
            # Concurrent batching is covered by tests/integration/test_batched_workers.py and tests/fault.
            "OMNI_STAGE_MAX_IN_FLIGHT": "1",
            "OMNI_PRIORITY_AGING_S": str(PRIORITY_AGING_S),
            "OMNI_ADMIN_TENANTS": "ops",  # test_usage: an admin's key sees every tenant's usage
            **WEBHOOK_ENV,
        },
    )
    try:
        system.start(say=lambda _msg: None)
        yield system
    finally:
        system.stop()


def auth_headers(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


@pytest.fixture
def api(system: EmbeddedSystem) -> Iterator[httpx.Client]:
    """The API as the demo tenant (the system's own key: auth is on in the tests, as in deployments)."""
    with httpx.Client(base_url=system.api_url, timeout=30, headers=auth_headers(system.api_key),
                      event_hooks={"response": [check_job_responses]}) as client:  # every job JSON is a JobView
        yield client
