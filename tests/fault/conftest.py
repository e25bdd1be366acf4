"""A whole system of its own for fault tests: they kill workers, the API, Redis and S3 under it.

Real processes with the settings a deployment uses (AOF with appendfsync always, the default
visibility timeout of an hour, the default 15 s leases): recovery must not come from tuning. The
job store and the Celery broker are two Redis servers here (OMNI_BROKER_URL), so that each can
fail alone. Workers reach S3 (moto) through a gate proxy that can hold an upload in flight, and
they journal every engine run, so duplicates are counted from outside the job store.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import httpx
import pytest
import yaml

from omni_jobs.core.settings import Settings
from omni_jobs.local.devservices import RunningService, free_port, start_moto_s3, start_redis
from omni_jobs.local.embedded import EmbeddedSystem
from omni_jobs.report.webhooks import generate_secret
from omni_jobs.run.run_journal import read_journal
from tests.fault.gate_proxy import GateProxy
from tests.webhook_receiver import WebhookReceiver

REPO = Path(__file__).resolve().parents[2]
MAX_QUEUED = 50
HARD_LIMIT_S = 1.5
BUCKET = "omni-faults"
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
LONG_PIPELINE = {
    "name": "long-dit",
    "description": "A DiT stage on its own queue, longer than that queue's workers' visibility timeout.",
    "inputs": {"prompt": {"type": "text"}},
    "stages": [{"id": "dit", "engine": "dit", "model": "tiny:pixart", "queue": "dit-long",
                "inputs": {"prompt": "input.prompt"}, "engine_args": {"pipeline_class": "PixArtSigmaPipeline"},
                "defaults": {"height": 384, "width": 384, "num_inference_steps": 200}}],  # ~8 s on an idle 2-core VM: well past the test's 2 s visibility timeout
    "outputs": [{"name": "image", "from": "dit.image"}],
}

GPU_IMAGE_PIPELINE = {
    "name": "gpu-image",
    "description": "The benchmark's GPU-shaped DiT (a stand-in for one on a GPU: it runs in an engine process of its "
                   "own under OMNI_ENGINE_PROCESS=auto), slow enough to be caught mid-batch.",
    "inputs": {"prompt": {"type": "text"}},
    "stages": [{"id": "dit", "engine": "dit", "model": "gpu-shaped", "inputs": {"prompt": "input.prompt"},
                "engine_args": {"kind": "gpu-shaped", "ms_per_image": 400},
                "defaults": {"height": 64, "width": 64, "num_inference_steps": 30}}],
    "outputs": [{"name": "image", "from": "dit.image"}],
}
@dataclass
class FaultSystem:
    system: EmbeddedSystem
    state: RunningService
    broker: RunningService
    s3: RunningService
    gate: GateProxy
    receiver: WebhookReceiver
    journal: Path
    webhook_secret: str

    def process(self, name: str) -> RunningService:
        return next(p for p in self.system.processes if p.name == name)

    def engine_starts(self, job_id: str) -> dict[tuple[str, int], int]:
        """(slot, attempt) -> how many times an engine started on it (from the workers' journal)."""
        counts: dict[tuple[str, int], int] = {}
        for line in read_journal(self.journal):
            if line["job_id"] == job_id and line["event"] == "engine.start":
                key = (str(line["slot"]), int(line["attempt"]))  # type: ignore[call-overload]
                counts[key] = counts.get(key, 0) + 1
        return counts

    def output_files(self, job_id: str) -> list[str]:
        """Final files under the job's outputs prefix in S3, as a client would list them."""
        s3 = boto3.client("s3", endpoint_url=self.s3.url, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
        listing = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"jobs/{job_id}/outputs/")
        return sorted(o["Key"] for o in listing.get("Contents", []))


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
    (pipelines / "long-dit.yaml").write_text(yaml.safe_dump(LONG_PIPELINE))
    (pipelines / "gpu-image.yaml").write_text(yaml.safe_dump(GPU_IMAGE_PIPELINE))
    state = start_redis(data_dir=home / "state", appendonly=True, appendfsync="always")
    broker = start_redis(data_dir=home / "broker", appendonly=True, appendfsync="always")
    s3 = start_moto_s3()
    journal = home / "engine-runs.jsonl"
    secret = generate_secret()
    settings = Settings(models_dir=REPO / "var" / "models", artifacts_dir=home / "artifacts", redis_url=state.url)
    with GateProxy(s3.port) as gate, WebhookReceiver() as receiver:
        system = EmbeddedSystem(
            settings=settings,
            home=home,
            api_port=free_port(),
            redis_url=state.url,
            with_flower=False,
            worker_queues={"ar": "threads", "dit": "threads", "talker": "threads", "code2wav": "threads",
                           "results": "solo", "webhooks": "threads"},
            extra_env={
                "OMNI_BROKER_URL": broker.url,
                "OMNI_ARTIFACT_BACKEND": "s3",
                "OMNI_S3_ENDPOINT_URL": gate.url,
                "OMNI_S3_BUCKET": BUCKET,
                "OMNI_S3_ACCESS_KEY_ID": "testing",
                "OMNI_S3_SECRET_ACCESS_KEY": "testing",
                "OMNI_REDIS_ARTIFACT_MAX_BYTES": "2048",
                "OMNI_STAGE_MAX_RETRIES": "4",
                "OMNI_STAGE_RETRY_BACKOFF_S": "0.5",
                "OMNI_MAX_QUEUED_PER_QUEUE": str(MAX_QUEUED),
                "OMNI_PIPELINES_PATH": json.dumps([str(pipelines)]),
                "OMNI_RUN_JOURNAL": str(journal),
                "OMNI_WEBHOOK_SECRET": secret,
                "OMNI_WEBHOOK_ALLOW_HOSTS": '["127.0.0.1"]',
                "OMNI_WEBHOOK_RETRY_BASE_S": "0.5",
                "OMNI_WEBHOOK_PROGRESS_INTERVAL_S": "0",
            },
        )
        try:
            system.start(say=lambda _msg: None)
            yield FaultSystem(system, state, broker, s3, gate, receiver, journal, secret)
        finally:
            gate.release()
            system.stop()
            s3.stop()
            broker.stop()
            state.stop()


@pytest.fixture
def api(faults: FaultSystem) -> Iterator[httpx.Client]:
    key = faults.system.api_key
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=faults.system.api_url, timeout=30, headers=headers) as client:
        yield client


@pytest.fixture(autouse=True)
def everything_running(faults: FaultSystem) -> Iterator[None]:
    """Each test starts and ends with every process up (a failed test must not break the next)."""
    for service in (faults.state, faults.broker, faults.s3):
        if not service.running:
            service.start()
    faults.gate.release()
    faults.system.supervise(say=lambda _msg: None)
    yield
    faults.gate.release()
    for service in (faults.state, faults.broker, faults.s3):
        if not service.running:
            service.start()
    faults.system.supervise(say=lambda _msg: None)
