"""Client-side helpers the end-to-end tests share."""

from __future__ import annotations

import time
from typing import Any

import httpx


def wait_for_job(api: httpx.Client, job_id: str, timeout_s: float = 180) -> dict[str, Any]:
    """Poll until the job is final; returns its JSON."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job: dict[str, Any] = api.get(f"/v1/jobs/{job_id}").raise_for_status().json()
        if job["status"] in ("succeeded", "failed", "canceled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} not final after {timeout_s}s: {job['status']} {job.get('stage')}")


def submit(api: httpx.Client, pipeline: str, prompt: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    response = api.post("/v1/jobs", json={"pipeline": pipeline, "input": {"prompt": prompt}, "params": params or {}})
    assert response.status_code == 202, response.text
    return response.json()
