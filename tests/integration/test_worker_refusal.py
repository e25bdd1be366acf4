"""A worker that cannot do its job refuses to start (exit 78) and says what to install or fix.

Real Celery worker processes on the session Redis: an engine library outside its supported range
stops the worker before it touches the broker; a built-in pipeline's model that cannot load stops
it while preloading; a user pipeline's broken model does not, unless OMNI_REFUSE_BROKEN_MODELS=all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
import yaml

from omni_jobs.local.devservices import RunningService
from omni_jobs.worker_registry import live_workers
from workers.startup import EXIT_REFUSED

ROOT = Path(__file__).resolve().parents[2]
REFUSAL_DB = 6  # apart from DB 0 (flushed by other integration tests) and DB 3 (the e2e system)
BROKEN_USER_PIPELINE = {
    "name": "my-broken",
    "inputs": {"prompt": {"type": "text"}},
    "stages": [{"id": "ar", "engine": "ar", "model": "/nonexistent/user-model", "queue": "my-broken",
                "inputs": {"prompt": "input.prompt"}}],
    "outputs": [{"name": "text", "from": "ar.text"}],
}


def worker_argv(queue: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "workers.app:app", "worker", "-Q", queue, "-P", "solo", "-c", "1",
            "-n", f"refusal-{uuid.uuid4().hex[:6]}@%h", "--loglevel", "INFO"]


def worker_env(redis_service: RunningService, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    env.update(OMNI_REDIS_URL=f"redis://127.0.0.1:{redis_service.port}/{REFUSAL_DB}",
               OMNI_MODELS_DIR=str(ROOT / "var" / "models"), OMNI_ARTIFACTS_DIR=str(tmp_path / "artifacts"),
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_worker(queue: str, env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(worker_argv(queue), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
                          check=False)


def user_pipeline(tmp_path: Path) -> str:
    path = tmp_path / "my-broken.yaml"
    path.write_text(yaml.safe_dump(BROKEN_USER_PIPELINE))
    return json.dumps([str(path)])


def test_engine_library_outside_its_range_refuses_before_the_broker(redis_service: RunningService,
                                                                      tmp_path: Path) -> None:
    started = time.monotonic()
    proc = run_worker("dit", worker_env(redis_service, tmp_path, OMNI_SUPPORTED_VERSIONS='{"diffusers": ">=99"}'))
    assert proc.returncode == EXIT_REFUSED, proc.stdout + proc.stderr
    assert time.monotonic() - started < 60  # no engine was loaded
    assert "refuses to start" in proc.stderr
    assert "diffusers 0.42" in proc.stderr and "is outside the supported range >=99" in proc.stderr
    assert "pip install 'diffusers>=99'" in proc.stderr
    # The same override does not concern a worker that runs no diffusers stage: its check passes.
    results = run_worker("no-such-queue", worker_env(redis_service, tmp_path, OMNI_SUPPORTED_VERSIONS='{"celery": ">=99"}'))
    assert results.returncode == EXIT_REFUSED and "celery 5." in results.stderr


def test_builtin_model_that_cannot_load_refuses_with_the_fix(redis_service: RunningService, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "models-is-a-file"
    not_a_dir.write_text("")
    proc = run_worker("ar", worker_env(redis_service, tmp_path, OMNI_MODELS_DIR=str(not_a_dir)))
    assert proc.returncode == EXIT_REFUSED, proc.stdout + proc.stderr
    assert "pipeline 'text-to-text' stage 'ar' (ar, model tiny:llama)" in proc.stderr
    assert "point OMNI_MODELS_DIR (or the model path) at a readable, writable directory" in proc.stderr
    # The refusal is also one JSON log line, for log pipelines.
    critical = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{") and "CRITICAL" in line]
    assert critical and "refuses to start" in critical[0]["message"]


def test_user_pipeline_with_a_broken_model_refuses_only_when_asked(redis_service: RunningService,
                                                                    tmp_path: Path) -> None:
    pipelines = user_pipeline(tmp_path)
    refused = run_worker("my-broken", worker_env(redis_service, tmp_path, OMNI_PIPELINES_PATH=pipelines,
                                                  OMNI_REFUSE_BROKEN_MODELS="all"))
    assert refused.returncode == EXIT_REFUSED, refused.stdout + refused.stderr
    assert "pipeline 'my-broken' stage 'ar'" in refused.stderr and "/nonexistent/user-model" in refused.stderr
    assert "make the model path exist on this host" in refused.stderr

    # Default policy ('builtin'): the worker starts and serves; the error is logged, its jobs will fail.
    env = worker_env(redis_service, tmp_path, OMNI_PIPELINES_PATH=pipelines)
    log_path = tmp_path / "worker.log"
    client = redis.Redis.from_url(env["OMNI_REDIS_URL"])
    with log_path.open("w") as log:
        worker = subprocess.Popen(worker_argv("my-broken"), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while "my-broken" not in live_workers(client):
            assert worker.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        logged = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
        errors = [e for e in logged if e["level"] == "ERROR" and "/nonexistent/user-model" in e["message"]]
        assert errors and "OMNI_REFUSE_BROKEN_MODELS=builtin" in errors[0]["message"]
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        client.flushdb()
        client.close()
