"""A worker that cannot do its job refuses to start (exit 78) and says what to install or fix.

Real Celery worker processes on the session Redis: an engine library outside its supported range
stops the worker before it touches the broker; a built-in pipeline's model that cannot load stops
it while preloading; a user pipeline's broken model does not, unless OMNI_REFUSE_BROKEN_MODELS=all.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
import yaml

from omni_jobs.dispatch.worker_registry import live_workers
from omni_jobs.local.devservices import RunningService
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


def test_a_second_worker_with_a_live_workers_name_refuses_and_takes_none_of_its_leases(
        redis_service: RunningService, tmp_path: Path) -> None:
    """`-n webhooks@%h` twice on one host: the second took back every lease of the first, live, as if
    it were the first one restarted. Now it refuses to start (78), naming the other; once the first
    is SIGKILLed, a worker of that name starts at once and takes back what the dead one held."""
    from omni_jobs.jobs.ledger import Acquired, JobLedger
    from omni_jobs.jobs.models import Job, StageRecord, StageStatus, new_job_id
    from omni_jobs.jobs.redis_store import RedisJobStore

    env = worker_env(redis_service, tmp_path)
    client = redis.Redis.from_url(env["OMNI_REDIS_URL"])
    name = f"twin-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
    argv = [*worker_argv("webhooks")[:-4], "-n", name, "--loglevel", "INFO"]
    log_path = tmp_path / "first.log"
    with log_path.open("w") as log:
        first = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    ledger = JobLedger(RedisJobStore(client, ttl_s=3600), lease_s=3600)
    try:
        deadline = time.monotonic() + 90
        while name not in live_workers(client).get("webhooks", []):
            assert first.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        # A stage the first worker runs (its process's lease, renewed for an hour).
        job, _ = ledger.submit(Job(id=new_job_id(), pipeline="p", input={},
                                   stages=[StageRecord(id="s", engine="ar", queue="s")]), ["s"])
        from omni_jobs.jobs.steps import RunStage
        held = ledger.acquire(RunStage(job.id, "s", 1, "s"), worker=name, owner=f"{name}#{first.pid}.feed/1")
        assert isinstance(held, Acquired)

        second = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 90
        while second.poll() is None:
            record = ledger.require(job.id).stage_record("s")
            if record.status is not StageStatus.running or time.monotonic() > deadline:
                second.kill()
                output = second.communicate()[0]
                raise AssertionError(f"the second worker started and took the live first's lease ({record.status}): "
                                     f"{output[-2000:]}")
            time.sleep(0.2)
        output = second.communicate()[0]
        assert second.returncode == EXIT_REFUSED, output
        assert f"another worker named {name} is running (pid {first.pid}" in output
        assert "-n" in output  # the fix: a name of its own
        record = ledger.require(job.id).stage_record("s")
        assert record.status is StageStatus.running and record.attempts == 1  # its lease was left alone
        assert first.poll() is None

        first.kill()  # SIGKILL: the name's claim stays, but its process is gone
        first.wait(timeout=30)
        log_path2 = tmp_path / "restarted.log"
        with log_path2.open("w") as log:
            restarted = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 90
            while ledger.require(job.id).stage_record("s").status is StageStatus.running:
                assert restarted.poll() is None, log_path2.read_text()
                assert time.monotonic() < deadline, log_path2.read_text()
                time.sleep(0.2)
            assert ledger.require(job.id).stage_record("s").attempts == 1  # taken back: attempt 2 is queued
        finally:
            restarted.terminate()
            restarted.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
        client.flushdb()
        client.close()
