"""SSE progress streams and Prefer: wait, through the real API and workers, read by a real HTTP client."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.helpers import submit, wait_for_job
from tests.e2e.job_contract import assert_job_view

SMALL_IMAGE = {"ar": {"max_tokens": 6}, "dit": {"height": 32, "width": 32, "num_inference_steps": 4, "seed": 2}}
SLOW_IMAGE = {"ar": {"max_tokens": 4}, "dit": {"height": 384, "width": 384, "num_inference_steps": 200}}


def read_sse(system: EmbeddedSystem, job_id: str, headers: dict[str, str] | None = None,
             query: dict[str, str] | None = None,
             timeout_s: float = 120) -> tuple[httpx.Response, list[dict[str, Any]], float]:
    """Every message of the stream until the server closes it: [{id, event, data}], and how long it took."""
    messages: list[dict[str, Any]] = []
    started = time.monotonic()
    with httpx.stream("GET", f"{system.api_url}/v1/jobs/{job_id}/events",
                      headers={"authorization": f"Bearer {system.api_key}", **(headers or {})},
                      params=query, timeout=httpx.Timeout(10, read=30)) as response:
        if response.status_code != 200:
            response.read()
            return response, [], 0.0
        current: dict[str, Any] = {}
        for line in response.iter_lines():
            assert time.monotonic() - started < timeout_s, "the stream did not end"
            if not line:
                if "data" in current:
                    if current["data"].get("job") is not None:  # a final event carries the job: a JobView
                        assert_job_view(current["data"]["job"])
                    messages.append(current)
                current = {}
            elif line.startswith((":", "retry:")):
                continue
            else:
                name, _, value = line.partition(": ")
                current[name] = json.loads(value) if name == "data" else value
    return response, messages, time.monotonic() - started


def test_sse_streams_a_jobs_events_until_it_ends(api: httpx.Client, system: EmbeddedSystem) -> None:
    job = submit(api, "text-to-image", "a striped lighthouse", SMALL_IMAGE)
    response, messages, _ = read_sse(system, job["id"])
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"

    types = [m["event"] for m in messages]
    stages = [m["data"]["data"].get("stage") for m in messages]
    assert all(m["data"]["type"] == m["event"] and m["data"]["job_id"] == job["id"] for m in messages)
    ids = [tuple(int(p) for p in m["id"].split("-")) for m in messages]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)

    # The story in order (AR progress events may come between its start and end).
    expected = [("job.queued", None), ("stage.queued", "ar"), ("job.running", None), ("stage.started", "ar"),
                ("stage.succeeded", "ar"), ("stage.queued", "dit"), ("stage.started", "dit"),
                ("stage.succeeded", "dit"), ("job.succeeded", None)]
    milestones = [(t, s) for t, s in zip(types, stages, strict=True) if t not in ("stage.progress", "output.delta")]
    assert milestones == expected
    assert types[-1] == "job.succeeded"

    dit_steps = [(m["data"]["data"]["step"], m["data"]["data"]["total"], m["data"]["data"]["unit"])
                 for m in messages if m["event"] == "stage.progress" and m["data"]["data"]["stage"] == "dit"]
    assert dit_steps and dit_steps[-1] == (4, 4, "steps")
    assert [s for s, _, _ in dit_steps] == sorted(s for s, _, _ in dit_steps)
    dit_start, dit_end = types.index("stage.started", types.index("stage.queued", 2)), types.index("job.succeeded")
    assert all(dit_start < i < dit_end for i, m in enumerate(messages)
               if m["event"] == "stage.progress" and m["data"]["data"]["stage"] == "dit")
    # The AR stage's progress shows if the stream was open by the worker's first ask about the job
    # (~20 ms after its start; a job counts as watched until then); a stream that came later sees the
    # progress of a stage this short only from the next ask, 0.25 s on, if the stage still runs.
    ar_start, ar_end = types.index("stage.started"), types.index("stage.succeeded")
    assert all(ar_start < i < ar_end for i, m in enumerate(messages)
               if m["event"] == "stage.progress" and m["data"]["data"]["stage"] == "ar")

    final = messages[-1]["data"]
    assert final["job"]["status"] == "succeeded" and {o["name"] for o in final["job"]["outputs"]} == {"image", "text"}
    assert final["job"] == {**api.get(f"/v1/jobs/{job['id']}").json(), "outputs": final["job"]["outputs"],
                            "queue_position": None}


def test_sse_resumes_after_last_event_id_and_closes_for_finished_jobs(api: httpx.Client,
                                                                      system: EmbeddedSystem) -> None:
    job = wait_for_job(api, submit(api, "text-to-image", "a resumed stream", SMALL_IMAGE)["id"])
    _, history, took = read_sse(system, job["id"])
    assert history[-1]["event"] == "job.succeeded" and took < 5  # replayed at once, then closed

    middle = next(i for i, m in enumerate(history) if m["event"] == "stage.started" and
                  m["data"]["data"]["stage"] == "dit")
    _, resumed, _ = read_sse(system, job["id"], {"Last-Event-ID": history[middle]["id"]})
    assert [m["id"] for m in resumed] == [m["id"] for m in history[middle + 1:]]
    _, by_query, _ = read_sse(system, job["id"], query={"after": history[middle]["id"]})
    assert [m["id"] for m in by_query] == [m["id"] for m in resumed]

    _, nothing, took = read_sse(system, job["id"], {"Last-Event-ID": history[-1]["id"]})
    assert nothing == [] and took < 5

    bad, _, _ = read_sse(system, job["id"], {"Last-Event-ID": "yesterday"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["header", "Last-Event-ID"]
    missing, _, _ = read_sse(system, "job_does_not_exist")
    assert missing.status_code == 404


def test_prefer_wait_returns_the_finished_job_in_one_call(api: httpx.Client) -> None:
    body = {"pipeline": "text-to-image", "input": {"prompt": "a quick one"}, "params": SMALL_IMAGE}
    response = api.post("/v1/jobs", json=body, headers={"Prefer": "wait=25"}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["preference-applied"] == "wait=25"
    job = response.json()
    assert job["status"] == "succeeded" and job["queue_position"] is None
    assert {o["name"] for o in job["outputs"]} == {"image", "text"}
    assert all(s["status"] == "succeeded" and s["wait_s"] is not None and s["wait_s"] >= 0 for s in job["stages"])

    plain = api.post("/v1/jobs", json=body)
    assert plain.status_code == 202 and "preference-applied" not in plain.headers


def test_prefer_wait_gives_the_running_job_when_time_runs_out(api: httpx.Client) -> None:
    body = {"pipeline": "text-to-image", "input": {"prompt": "a slow one"}, "params": SLOW_IMAGE}
    started = time.monotonic()
    response = api.post("/v1/jobs", json=body, headers={"Prefer": "respond-async, wait=1.5"}, timeout=60)
    took = time.monotonic() - started
    assert response.status_code == 202, response.text
    job = response.json()
    try:
        assert response.headers["preference-applied"] == "wait=1.5"
        assert 1.4 <= took < 10
        assert job["status"] in ("queued", "running") and job["completed_at"] is None
    finally:
        api.post(f"/v1/jobs/{job['id']}/cancel")


def test_prefer_wait_is_capped_by_the_server(api: httpx.Client) -> None:
    body = {"pipeline": "text-to-text", "input": {"prompt": "cap"}, "params": {"ar": {"max_tokens": 4}}}
    response = api.post("/v1/jobs", json=body, headers={"Prefer": "wait=3600"}, timeout=60)
    assert response.status_code == 200 and response.headers["preference-applied"] == "wait=30"


def test_running_job_shows_stage_progress_and_queue_position_when_waiting(api: httpx.Client) -> None:
    slow = submit(api, "text-to-image", "occupies the dit worker", SLOW_IMAGE)
    behind = submit(api, "text-to-image", "waits behind it", SLOW_IMAGE)
    try:
        deadline = time.monotonic() + 60
        seen_progress = seen_position = False
        while time.monotonic() < deadline and not (seen_progress and seen_position):
            a = api.get(f"/v1/jobs/{slow['id']}").json()
            b = api.get(f"/v1/jobs/{behind['id']}").json()
            slow_runs_dit = bool(a["stage"] == "dit" and a["progress"] and a["progress"]["step"] >= 1)
            if slow_runs_dit:
                assert a["progress"]["total"] == 200 and a["progress"]["unit"] == "steps"
                assert a["progress"]["stage"] == "dit" and a["queue_position"] is None
                seen_progress = True
            if slow_runs_dit and b["status"] == "running" and b["stage"] is None and b["queue_position"] is not None:
                # ar done, its dit stage waits on the dit queue right behind the slow job (an earlier
                # test's canceled job may still hold the worker for a step: then both wait)
                dit = next(s for s in b["stages"] if s["id"] == "dit")
                assert dit["status"] == "queued" and b["queue_position"] == 1
                seen_position = True
            time.sleep(0.05)
        assert seen_progress and seen_position
    finally:
        for job in (behind, slow):
            api.post(f"/v1/jobs/{job['id']}/cancel")
    assert wait_for_job(api, slow["id"])["status"] == "canceled"


@pytest.mark.parametrize("header", ["wait=abc", "return=minimal"])
def test_unreadable_preferences_are_ignored(api: httpx.Client, header: str) -> None:
    body = {"pipeline": "text-to-text", "input": {"prompt": "x"}, "params": {"ar": {"max_tokens": 2}}}
    response = api.post("/v1/jobs", json=body, headers={"Prefer": header})
    assert response.status_code == 202 and "preference-applied" not in response.headers
