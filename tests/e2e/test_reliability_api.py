"""Idempotency-Key, Cancel-After and cancellation, through the HTTP API with real workers."""

from __future__ import annotations

import time

import httpx

from tests.e2e.helpers import submit, wait_for_job

BODY = {"pipeline": "text-to-text", "input": {"prompt": "idempotent"}, "params": {"ar": {"max_tokens": 3}}}
SLOW = {"dit": {"height": 256, "width": 256, "num_inference_steps": 200}, "ar": {"max_tokens": 2}}


def test_idempotency_key_same_body_same_job_different_body_409(api: httpx.Client) -> None:
    key = f"key-{time.time_ns()}"
    first = api.post("/v1/jobs", json=BODY, headers={"Idempotency-Key": key})
    again = api.post("/v1/jobs", json=BODY, headers={"Idempotency-Key": key})
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    assert "idempotent-replayed" not in first.headers and again.headers["idempotent-replayed"] == "true"
    other = api.post("/v1/jobs", json={**BODY, "input": {"prompt": "something else"}}, headers={"Idempotency-Key": key})
    assert other.status_code == 409 and first.json()["id"] in other.json()["detail"]
    assert wait_for_job(api, first.json()["id"])["status"] == "succeeded"
    listed = [j["id"] for j in api.get("/v1/jobs", params={"limit": 50}).json()["data"]]
    assert listed.count(first.json()["id"]) == 1


def test_cancel_a_running_job_stops_it_and_the_worker_serves_the_next(api: httpx.Client) -> None:
    job = submit(api, "text-to-image", "cancel me", SLOW)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        current = api.get(f"/v1/jobs/{job['id']}").json()
        if current["stage"] == "dit" and current["progress"]:
            break
        time.sleep(0.05)
    canceled = api.post(f"/v1/jobs/{job['id']}/cancel")
    assert canceled.status_code == 200 and canceled.json()["status"] == "canceled"
    final = wait_for_job(api, job["id"])
    assert final["status"] == "canceled" and final["outputs"] == []
    dit = next(s for s in final["stages"] if s["id"] == "dit")
    assert dit["status"] == "canceled"
    time.sleep(1)  # the worker notices at its next step; nothing is written after that
    after = api.get(f"/v1/jobs/{job['id']}").json()
    assert after["status"] == "canceled" and after["progress"] is None
    nxt = wait_for_job(api, submit(api, "text-to-image", "next one", {"dit": {"height": 32, "width": 32,
                                                                              "num_inference_steps": 2}})["id"])
    assert nxt["status"] == "succeeded"


def test_cancel_after_header_ends_a_job_that_runs_too_long(api: httpx.Client) -> None:
    response = api.post("/v1/jobs", json={"pipeline": "text-to-image", "input": {"prompt": "deadline"},
                                          "params": SLOW}, headers={"Cancel-After": "1s"})
    assert response.status_code == 202
    job = response.json()
    assert job["deadline_at"] == job["created_at"] + 1
    final = wait_for_job(api, job["id"])
    assert final["status"] == "canceled"
    assert final["completed_at"] - final["created_at"] < 30


def test_bad_cancel_after_is_422_naming_the_header(api: httpx.Client) -> None:
    response = api.post("/v1/jobs", json=BODY, headers={"Cancel-After": "soon"})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["header", "Cancel-After"]
