"""One job traced everywhere: Prometheus metrics of the API and every worker, JSON logs carrying its
id, Flower task names, readiness, and `omni-jobs doctor` against the running system."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.helpers import wait_for_job

ROOT = Path(__file__).resolve().parents[2]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    text = httpx.get(url, timeout=10).raise_for_status().text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def worker_url(system: EmbeddedSystem, node: str) -> str:
    return f"http://127.0.0.1:{system.metrics_ports[node]}/metrics"


def log_lines(system: EmbeddedSystem, name: str, job_id: str) -> list[dict[str, Any]]:
    lines = []
    for line in (system.logs / f"{name}.log").read_text(errors="replace").splitlines():
        if line.startswith("{") and job_id in line:
            lines.append(json.loads(line))
    return lines


@pytest.fixture(scope="module")
def traced_job(system: EmbeddedSystem) -> Iterator[dict[str, Any]]:
    """One text-to-image job, with every process's metrics scraped before and after it."""
    nodes = ("ar", "dit", "results")
    before = {"api": scrape(f"{system.api_url}/metrics"), **{n: scrape(worker_url(system, n)) for n in nodes}}
    with httpx.Client(base_url=system.api_url, timeout=30,
                      headers={"authorization": f"Bearer {system.api_key}"}) as api:
        body = {"pipeline": "text-to-image", "input": {"prompt": "a lighthouse, traced"},
                "params": {"dit": {"height": 48, "width": 48, "num_inference_steps": 2, "seed": 1}}}
        accepted = api.post("/v1/jobs", json=body, headers={"x-request-id": "trace-me-1"})
        assert accepted.status_code == 202 and accepted.headers["x-request-id"] == "trace-me-1"
        job = wait_for_job(api, accepted.json()["id"])
    assert job["status"] == "succeeded", job["error"]
    after = {"api": scrape(f"{system.api_url}/metrics"), **{n: scrape(worker_url(system, n)) for n in nodes}}
    yield {"job": job, "before": before, "after": after}


def delta(traced: dict[str, Any], process: str, name: str, **labels: str) -> float:
    return value(traced["after"][process], name, **labels) - value(traced["before"][process], name, **labels)


def test_api_metrics_count_the_job_and_read_queues(traced_job: dict[str, Any]) -> None:
    after = traced_job["after"]["api"]
    assert delta(traced_job, "api", "omni_jobs_jobs_total", pipeline="text-to-image", status="queued") == 1
    assert delta(traced_job, "api", "omni_jobs_http_requests_total", method="POST", route="/v1/jobs",
                 status="202") == 1
    assert delta(traced_job, "api", "omni_jobs_http_requests_total", method="GET", route="/v1/jobs/{job_id}",
                 status="200") >= 1
    for queue in ("ar", "dit", "results"):
        assert ("omni_jobs_queue_depth", frozenset({("queue", queue)})) in after
        assert value(after, "omni_jobs_queue_workers", queue=queue) >= 1


def test_worker_metrics_follow_the_job_through_each_stage(traced_job: dict[str, Any]) -> None:
    job = traced_job["job"]
    ar, dit = job["stages"]
    p = "text-to-image"
    # The AR worker: the job started running there, one batch, a preloaded engine (cache hit), timings.
    assert delta(traced_job, "ar", "omni_jobs_jobs_total", pipeline=p, status="running") == 1
    assert delta(traced_job, "ar", "omni_jobs_stage_queue_wait_seconds_count", pipeline=p, stage="ar", queue="ar") == 1
    assert delta(traced_job, "ar", "omni_jobs_stage_duration_seconds_sum", pipeline=p, stage="ar", engine="ar",
                 outcome="succeeded") == pytest.approx(ar["duration_s"], abs=1e-6)
    assert delta(traced_job, "ar", "omni_jobs_engine_batch_size_count", engine="ar") == 1
    assert delta(traced_job, "ar", "omni_jobs_cache_requests_total", cache="engine", result="hit") >= 1
    assert delta(traced_job, "ar", "omni_jobs_cache_requests_total", cache="engine", result="miss") == 0
    assert value(traced_job["after"]["ar"], "omni_jobs_engine_memory_bytes", pipeline=p, stage="ar", engine="ar",
                 device="cpu") > 200 * 2**20  # vLLM in the process: hundreds of MiB
    small = sum(ref["size"] for ref in ar["outputs"].values() if ref["backend"] == "redis")
    assert small > 0 and delta(traced_job, "ar", "omni_jobs_artifact_bytes_total", backend="redis", op="put") == small
    # The DiT worker wrote the job's final files to S3, inline (OMNI_RESULTS_INLINE) as the last stage's
    # worker; its image is stored once: the stage's recorded output is the job's image file.
    image_ref = dit["outputs"]["image"]
    assert image_ref["backend"] == "s3" and image_ref["key"] == f"jobs/{job['id']}/outputs/image.png"
    final_files = sum(o["size"] for o in job["outputs"])
    assert delta(traced_job, "dit", "omni_jobs_artifact_bytes_total", backend="s3", op="put") == final_files
    assert delta(traced_job, "dit", "omni_jobs_engine_batch_size_count", engine="dit") == 1
    # its one batch: it ran within the stage's time, and its request waited at most the stage's time for it
    assert delta(traced_job, "dit", "omni_jobs_engine_batch_run_seconds_count", engine="dit") == 1
    assert 0 < delta(traced_job, "dit", "omni_jobs_engine_batch_run_seconds_sum", engine="dit") <= dit["duration_s"]
    assert 0 <= delta(traced_job, "dit", "omni_jobs_engine_batch_wait_seconds_sum", engine="dit") <= dit["duration_s"]
    assert delta(traced_job, "dit", "omni_jobs_stage_duration_seconds_count", pipeline=p, stage="dit", engine="dit",
                 outcome="succeeded") == 1
    # The DiT worker ended the job too (results inline); the results worker had nothing to do.
    assert delta(traced_job, "dit", "omni_jobs_jobs_total", pipeline=p, status="succeeded") == 1
    assert delta(traced_job, "results", "omni_jobs_jobs_total", pipeline=p, status="succeeded") == 0
    assert delta(traced_job, "dit", "omni_jobs_job_duration_seconds_sum", pipeline=p,
                 status="succeeded") == pytest.approx(job["metrics"]["total_time_s"], abs=1e-6)


def test_logs_carry_the_job_id_stage_and_task_id_everywhere(traced_job: dict[str, Any], system: EmbeddedSystem) -> None:
    job_id = traced_job["job"]["id"]
    api_lines = log_lines(system, "api", job_id)
    post = [e for e in api_lines if e.get("method") == "POST" and e.get("route") == "/v1/jobs"]
    assert post and post[0]["job_id"] == job_id and post[0]["request_id"] == "trace-me-1" and post[0]["status"] == 202
    assert any(e.get("route") == "/v1/jobs/{job_id}" and e["job_id"] == job_id for e in api_lines)

    task_ids: dict[str, str] = {}
    for node, stage in (("ar", "ar"), ("dit", "dit")):
        lines = [e for e in log_lines(system, f"worker-{node}", job_id) if e.get("job_id") == job_id]
        assert lines, f"no JSON log line of {job_id} in worker-{node}.log"
        assert {e["stage"] for e in lines} == {stage} and len({e["task_id"] for e in lines}) == 1
        task_ids[stage] = lines[0]["task_id"]
        assert all(e["service"] == "worker" for e in lines)

    # The task id is the step's outbox id (a re-published duplicate shows under the same id), and the
    # name a worker logs and reports contains the job id, the stage and the attempt.
    assert task_ids == {"ar": f"stage:{job_id}:ar:1", "dit": f"stage:{job_id}:dit:1"}
    for node, name in (("ar", f"omni.run_stage[{job_id}/ar#1]"), ("dit", f"omni.run_stage[{job_id}/dit#1]")):
        assert f"Task {name}[{task_ids[node]}] received" in (system.logs / f"worker-{node}.log").read_text()
    # The results were written inline by the worker of the last stage (OMNI_RESULTS_INLINE), inside its task.
    dit_lines = log_lines(system, "worker-dit", job_id)
    assert any("job succeeded with outputs" in e.get("message", "") and "(results inline)" in e.get("message", "")
               for e in dit_lines), dit_lines[-3:]
    assert not [e for e in log_lines(system, "worker-results", job_id) if e.get("job_id") == job_id]

    # Flower finds every task of the job by its id. (Flower takes the name from whichever of the
    # sender's task-sent and the worker's task-received events reaches it last: that race is Celery's.)
    flower = httpx.Client(base_url=system.flower_url, auth=(system.flower_user, system.flower_password), timeout=30)
    deadline = time.monotonic() + 20
    while True:
        found = flower.get("/api/tasks", params={"search": job_id}).json()
        if len(found) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(found) == set(task_ids.values())
    assert {task["state"] for task in found.values()} == {"SUCCESS"}


def test_readyz_sees_every_worker(api: httpx.Client) -> None:
    response = api.get("/readyz")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "ok" and body["redis"] == "ok" and body["artifact_store"] == "ok"
    assert body["missing"] == []
    for queue in ("ar", "dit", "results", "webhooks"):  # webhooks: the system signs webhooks
        assert body["workers"][queue] >= 1  # how many: their names (hosts) only to OMNI_METRICS_TOKEN


def test_doctor_against_the_running_system(system: EmbeddedSystem) -> None:
    proc = subprocess.run([sys.executable, "-m", "omni_jobs.cli", "doctor", "--json", "--no-devices"], cwd=ROOT,
                          env=system.child_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = {(c["section"], c["name"]): c for c in json.loads(proc.stdout)["checks"]}
    assert checks[("services", "redis")]["ok"] and checks[("services", "artifact store")]["ok"]
    assert "s3 bucket omni-e2e" in checks[("services", "artifact store")]["detail"]
    for queue in ("ar", "dit", "results", "webhooks"):
        assert checks[("workers", queue)]["ok"] and f"{queue}@" in checks[("workers", queue)]["detail"]
    assert all(checks[("versions", p)]["ok"] for p in ("vllm", "diffusers", "torch", "transformers", "celery"))


class _Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # http.server names handlers do_<METHOD>
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        return


def test_webhook_deliveries_are_counted_by_outcome(system: EmbeddedSystem, api: httpx.Client) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = worker_url(system, "webhooks")
    before = value(scrape(url), "omni_jobs_webhook_deliveries_total", event="completed", outcome="delivered")
    try:
        body = {"pipeline": "text-to-text", "input": {"prompt": "hook"}, "params": {"ar": {"max_tokens": 2}},
                "webhook": f"http://127.0.0.1:{server.server_port}/hook", "webhook_events_filter": ["completed"]}
        accepted = api.post("/v1/jobs", json=body)
        assert accepted.status_code == 202, accepted.text
        wait_for_job(api, accepted.json()["id"])
        deadline = time.monotonic() + 30
        while value(scrape(url), "omni_jobs_webhook_deliveries_total", event="completed",
                    outcome="delivered") < before + 1:
            assert time.monotonic() < deadline, "the completed webhook was not counted as delivered"
            time.sleep(0.2)
    finally:
        server.shutdown()
