"""Scheduling through the HTTP API with real workers: priority, tenants' fair share, no starvation,
quotas. The system runs one DiT task at a time (OMNI_STAGE_MAX_IN_FLIGHT=1), so its scheduler's
window is 3 (one running, the default slack of two released) and order shows plainly."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.conftest import PRIORITY_AGING_S, auth_headers
from tests.e2e.helpers import wait_for_job

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 3


def client_for(system: EmbeddedSystem, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=system.api_url, timeout=30, headers=auth_headers(system.create_api_key(tenant)))


def post(api: httpx.Client, prompt: str, priority: str = "normal") -> dict[str, Any]:
    response = api.post("/v1/jobs", json={"pipeline": "dit-only", "input": {"prompt": prompt}, "priority": priority})
    assert response.status_code == 202, response.text
    return dict(response.json())


def finish_all(api: httpx.Client, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    done = [wait_for_job(api, j["id"], timeout_s=300) for j in jobs]
    assert [d["status"] for d in done] == ["succeeded"] * len(done), [d["error"] for d in done]
    return done


def test_a_high_job_overtakes_a_queue_of_normal_ones(system: EmbeddedSystem) -> None:
    with client_for(system, "prio") as api:
        normal = [post(api, f"normal {i}") for i in range(12)]
        high = post(api, "urgent", "high")
        assert high["priority"] == "high" and high["queue_position"] is not None
        done = finish_all(api, [*normal, high])
    high_done = done[-1]["completed_at"]
    # Normal jobs that ended before the high one was even posted (a slow machine posts slowly) say
    # nothing about priority; of the others, only those already released may finish first.
    settled = sum(d["completed_at"] <= high["created_at"] for d in done[:-1])
    before = sum(high["created_at"] < d["completed_at"] < high_done for d in done[:-1])
    assert before <= WINDOW + 1, f"{before} normal jobs finished before the high one"  # those already released
    assert len(done) - 1 - settled - before >= 12 - settled - WINDOW - 1


def test_one_tenants_backlog_does_not_hold_another_back(system: EmbeddedSystem) -> None:
    with client_for(system, "tenant-a") as a, client_for(system, "tenant-b") as b:
        with ThreadPoolExecutor(8) as pool:
            a_jobs = list(pool.map(lambda i: post(a, f"a {i}"), range(40)))
        b_jobs = [post(b, f"b {i}") for i in range(3)]
        first_b = b.get(f"/v1/jobs/{b_jobs[0]['id']}").json()
        assert first_b["status"] != "queued" or first_b["queue_position"] <= WINDOW + 1  # A's 40 are not ahead
        b_done = finish_all(b, b_jobs)
        a_done = sorted(d["completed_at"] for d in finish_all(a, a_jobs))
    assert max(d["completed_at"] for d in b_done) < a_done[24], "B's 3 jobs must end before A's 25th"


def test_a_low_job_is_not_starved_by_normal_work_that_keeps_arriving(system: EmbeddedSystem) -> None:
    with client_for(system, "starve") as api:
        low = post(api, "low", "low")
        low_queued = time.time()
        normal: list[tuple[float, dict[str, Any]]] = []
        while time.time() - low_queued < 3 * PRIORITY_AGING_S:  # more than the worker can take
            normal.append((time.time(), post(api, f"n {len(normal)}")))
            time.sleep(0.05)
        low_done = wait_for_job(api, low["id"], timeout_s=120)
        done = finish_all(api, [job for _, job in normal])
    started_low = low_done["stages"][0]["started_at"]
    # Normal work queued more than the aging time after the low job goes after it (but for what was
    # already released when the low job's turn came).
    later = [d for (queued_at, _), d in zip(normal, done, strict=True) if queued_at > low_queued + PRIORITY_AGING_S]
    assert later, "the test sent no work after the aging time"
    passed_it = [d for d in later if d["stages"][0]["started_at"] < started_low]
    assert len(passed_it) <= WINDOW, f"{len(passed_it)} later normal jobs started before the low one"
    assert low_done["status"] == "succeeded"


def test_quotas_answer_429_with_retry_after_and_name_the_limit(system: EmbeddedSystem) -> None:
    env = system.child_env()

    def limits(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "omni_jobs.cli", "keys", "limits", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60, check=True)
        return proc.stdout

    assert "per_minute=2" in limits("--tenant", "quota-rate", "--per-minute", "2")
    with client_for(system, "quota-rate") as api:
        accepted = [post(api, f"q {i}") for i in range(2)]
        refused = api.post("/v1/jobs", json={"pipeline": "dit-only", "input": {"prompt": "one too many"}})
        assert refused.status_code == 429
        body = refused.json()
        assert body["limit"] == "jobs_per_minute" and body["value"] == 2 and "quota-rate" in body["detail"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        finish_all(api, accepted)

    limits("--tenant", "quota-busy", "--max-active", "1")
    with client_for(system, "quota-busy") as api:
        long = api.post("/v1/jobs", json={"pipeline": "dit-only", "input": {"prompt": "long"},
                                          "params": {"dit": {"num_inference_steps": 200, "height": 128, "width": 128}}})
        assert long.status_code == 202
        refused = api.post("/v1/jobs", json={"pipeline": "dit-only", "input": {"prompt": "second"}})
        assert refused.status_code == 429 and refused.json()["limit"] == "max_active"
        assert "retry-after" in refused.headers
        api.post(f"/v1/jobs/{long.json()['id']}/cancel").raise_for_status()  # its end makes room at once
        assert api.post("/v1/jobs", json={"pipeline": "dit-only", "input": {"prompt": "third"}}).status_code == 202
    metrics = httpx.get(f"{system.api_url}/metrics", timeout=10).text
    assert 'omni_jobs_quota_refusals_total{limit="max_active"}' in metrics
