"""A client that leaves while its request waits on a job (an OpenAI route, ``Prefer: wait``) stops that
job, unless the request carried an Idempotency-Key (issue 62): nobody can find the job otherwise, and an
SDK's retry submits it again. Real API, real workers, a real client that gives up (a short read timeout)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.conftest import auth_headers
from tests.e2e.helpers import wait_for_job

SLOW = {"ar": {"max_tokens": 2}, "dit": {"height": 384, "width": 384, "num_inference_steps": 200}}
"""Minutes of denoising on a CPU: running long after the client gave up."""
GONE_WITHIN_S = 10.0


def _client(system: EmbeddedSystem, read_s: float) -> httpx.Client:
    return httpx.Client(base_url=system.api_url, headers=auth_headers(system.api_key),
                        timeout=httpx.Timeout(10, read=read_s))


def _newest(api: httpx.Client, pipeline: str, since: float) -> dict[str, Any]:
    """The newest job of ``pipeline`` made after ``since`` (the answer that named it never came)."""
    jobs = [j for j in api.get("/v1/jobs", params={"limit": 20}).raise_for_status().json()["data"]
            if j["pipeline"] == pipeline and j["created_at"] >= since]
    assert jobs, f"no {pipeline} job since {since}"
    return max(jobs, key=lambda j: j["created_at"])


def _ends_canceled(api: httpx.Client, job_id: str) -> dict[str, Any]:
    job = wait_for_job(api, job_id, timeout_s=GONE_WITHIN_S)
    assert job["status"] == "canceled", job
    events = api.get(f"/v1/jobs/{job_id}/events", headers={"accept": "text/event-stream"}).text
    assert "client disconnected" in events  # the job.canceled event's reason
    return job


def test_an_openai_call_whose_client_leaves_cancels_its_job(system: EmbeddedSystem, api: httpx.Client) -> None:
    since = time.time() - 1
    with _client(system, 1.5) as gives_up, pytest.raises(httpx.ReadTimeout):
        gives_up.post("/v1/images/generations", json={"model": "text-to-image", "prompt": "a slow fox",
                                                      "size": "384x384", "num_inference_steps": 200,
                                                      "params": {"ar": {"max_tokens": 2}}})
    _ends_canceled(api, _newest(api, "text-to-image", since)["id"])


def test_a_streamed_chat_whose_client_leaves_cancels_its_job(system: EmbeddedSystem) -> None:
    with _client(system, 30) as reader, reader.stream(
            "POST", "/v1/chat/completions",
            json={"model": "text-to-text", "stream": True, "max_tokens": 4096,
                  "messages": [{"role": "user", "content": "Tell me everything"}]}) as response:
        assert response.status_code == 200
        job_id = response.headers["x-omni-job-id"]
        next(response.iter_lines())  # the first chunk came: the job runs; then the client goes
    with _client(system, 30) as api:
        _ends_canceled(api, job_id)


def test_prefer_wait_whose_client_leaves_cancels_its_job(system: EmbeddedSystem, api: httpx.Client) -> None:
    since = time.time() - 1
    with _client(system, 1.5) as gives_up, pytest.raises(httpx.ReadTimeout):
        gives_up.post("/v1/jobs", headers={"Prefer": "wait=60"},
                      json={"pipeline": "text-to-image", "input": {"prompt": "a slow owl"}, "params": SLOW})
    _ends_canceled(api, _newest(api, "text-to-image", since)["id"])


def test_with_an_idempotency_key_the_job_keeps_running_for_the_retry(system: EmbeddedSystem,
                                                                     api: httpx.Client) -> None:
    body = {"pipeline": "text-to-image", "input": {"prompt": "a slow heron"}, "params": SLOW}
    key = {"Prefer": "wait=60", "Idempotency-Key": f"heron-{time.time()}"}
    with _client(system, 1.5) as gives_up, pytest.raises(httpx.ReadTimeout):
        gives_up.post("/v1/jobs", headers=key, json=body)
    time.sleep(3)
    retry = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": key["Idempotency-Key"]})
    assert retry.headers.get("idempotent-replayed") == "true", retry.text
    assert retry.json()["status"] in ("queued", "running"), retry.json()  # the same job, still at work
    assert api.post(f"/v1/jobs/{retry.json()['id']}/cancel").status_code == 200  # not left for the next tests
