"""A whole system of its own for fault tests: they kill workers and restart Redis and S3.

Its own redis-server (AOF on, so a restart keeps what was accepted), its own moto S3, the API and
one worker per queue; a short visibility timeout so a killed worker's task comes back in seconds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from omni_jobs.devservices import RunningService, free_port, start_moto_s3, start_redis
from omni_jobs.embedded import EmbeddedSystem
from omni_jobs.settings import Settings

REPO = Path(__file__).resolve().parents[2]
VISIBILITY_TIMEOUT_S = 4
MAX_QUEUED = 3
HARD_LIMIT_S = 1.5
HARD_LIMIT_PIPELINE = {
    "name": "hard-limit",
    "description": "A DiT stage far longer than its hard time limit (and with a generous soft one).",
    "inputs": {"prompt": {"type": "text"}},
    "stages": [{"id": "dit", "engine": "dit", "model": "tiny:pixart", "inputs": {"prompt": "input.prompt"},
                "engine_args": {"pipeline_class": "PixArtSigmaPipeline"},
                "defaults": {"height": 256, "width": 256, "num_inference_steps": 200},
                "soft_time_limit_s": 120, "time_limit_s": HARD_LIMIT_S}],
    "outputs": [{"name": "image", "from": "dit.image"}],
}


@dataclass
class FaultSystem:
    system: EmbeddedSystem
    redis: RunningService
    s3: RunningService

    def process(self, name: str) -> RunningService:
        return next(p for p in self.system.processes if p.name == name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/fault" in str(item.path):
            item.add_marker(pytest.mark.fault)
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultSystem]:
    home = tmp_path_factory.mktemp("faults")
    pipelines = home / "pipelines"
    pipelines.mkdir()
    (pipelines / "hard-limit.yaml").write_text(yaml.safe_dump(HARD_LIMIT_PIPELINE))
    redis = start_redis(data_dir=home / "redis", appendonly=True)
    s3 = start_moto_s3()
    settings = Settings(models_dir=REPO / "var" / "models", artifacts_dir=home / "artifacts", redis_url=redis.url)
    system = EmbeddedSystem(
        settings=settings,
        home=home,
        api_port=free_port(),
        redis_url=redis.url,
        with_flower=False,
        extra_env={
            "OMNI_ARTIFACT_BACKEND": "s3",
            "OMNI_S3_ENDPOINT_URL": s3.url,
            "OMNI_S3_BUCKET": "omni-faults",
            "OMNI_S3_ACCESS_KEY_ID": "testing",
            "OMNI_S3_SECRET_ACCESS_KEY": "testing",
            "OMNI_REDIS_ARTIFACT_MAX_BYTES": "2048",
            "OMNI_VISIBILITY_TIMEOUT_S": str(VISIBILITY_TIMEOUT_S),
            "OMNI_STAGE_MAX_RETRIES": "4",
            "OMNI_STAGE_RETRY_BACKOFF_S": "0.5",
            "OMNI_MAX_QUEUED_PER_QUEUE": str(MAX_QUEUED),
            "OMNI_PIPELINES_PATH": json.dumps([str(pipelines)]),
        },
    )
    try:
        system.start(say=lambda _msg: None)
        yield FaultSystem(system, redis, s3)
    finally:
        system.stop()
        s3.stop()
        redis.stop()


@pytest.fixture
def api(faults: FaultSystem) -> Iterator[httpx.Client]:
    key = faults.system.api_key
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=faults.system.api_url, timeout=30, headers=headers) as client:
        yield client
