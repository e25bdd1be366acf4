"""A batch survives SIGKILL of its driver (the results worker), the AR worker, the API and Redis mid-run:
every line is in exactly one of the output and error files, the counts add up, no line made two jobs,
and no engine ran one attempt twice.

The default run is a 60-line batch; the 1,000-line one is behind the ``chaos`` marker:

    scripts/test -m chaos tests/fault/test_batch_faults.py -s
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.fault.conftest import FaultSystem

RUN_TIMEOUT_S = 600


def _lines(tag: str, n: int) -> bytes:
    rows = [{"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/jobs",
             "body": {"pipeline": "text-to-text", "input": {"prompt": f"{tag} line {i}"},
                      "params": {"ar": {"max_tokens": 2}}}} for i in range(n)]
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _get(api: httpx.Client, path: str) -> httpx.Response:
    """GET through an API that may be restarting: retried until it answers."""
    deadline = time.monotonic() + 120
    while True:
        try:
            response = api.get(path)
            if response.status_code < 500:
                return response
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"GET {path} did not answer within 120 s")
        time.sleep(0.3)


def _batch(api: httpx.Client, batch_id: str) -> dict[str, Any]:
    body: dict[str, Any] = _get(api, f"/v1/batches/{batch_id}").raise_for_status().json()
    return body


def _wait_progress(api: httpx.Client, batch_id: str, done: int) -> dict[str, Any]:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        batch = _batch(api, batch_id)
        counts = batch["request_counts"]
        if counts["completed"] + counts["failed"] >= done or batch["status"] not in ("validating", "in_progress"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} made no progress to {done} lines")


def _kill_all(faults: FaultSystem) -> None:
    """SIGKILL the batch driver's worker, the AR worker, the API, then the job store; bring them back."""
    for name in ("worker-results", "worker-ar", "api"):
        faults.process(name).kill()
    faults.state.kill()
    time.sleep(1.0)
    faults.state.start()
    faults.system.supervise(say=lambda _msg: None)  # what `omni-jobs up` does: the dead processes start again


def _tenant_jobs_with(api: httpx.Client, tag: str) -> list[str]:
    """Every job of the tenant whose prompt carries ``tag``: what the batch made, counted outside it."""
    ids: list[str] = []
    cursor: str | None = None
    while True:
        page = _get(api, "/v1/jobs?limit=100" + (f"&cursor={cursor}" if cursor else "")).raise_for_status().json()
        ids += [j["id"] for j in page["data"] if str(j["input"].get("prompt", "")).startswith(f"{tag} line ")]
        cursor = page.get("next_cursor")
        if not cursor:
            return ids


def run_batch_under_kills(faults: FaultSystem, api: httpx.Client, n: int, kills_at: tuple[float, ...]) -> None:
    tag = f"bf{time.time_ns()}"
    made = api.post("/v1/files", files={"file": ("faults.jsonl", _lines(tag, n))}, data={"purpose": "batch"})
    assert made.status_code == 200, made.text
    batch = api.post("/v1/batches", json={"input_file_id": made.json()["id"], "endpoint": "/v1/jobs",
                                          "completion_window": "24h"}).raise_for_status().json()
    started = time.monotonic()
    for share in kills_at:
        seen = _wait_progress(api, batch["id"], int(n * share))
        assert seen["status"] == "in_progress", f"the batch ended before the kill at {share:.0%}: {seen}"
        _kill_all(faults)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (ended := _batch(api, batch["id"]))["status"] not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch not ended after {RUN_TIMEOUT_S}s: {ended}"
        time.sleep(0.5)
    took = time.monotonic() - started
    assert ended["status"] == "completed", ended
    outputs = [json.loads(x) for x in _get(api, f"/v1/files/{ended['output_file_id']}/content").content.splitlines()]
    errors = ([json.loads(x) for x in _get(api, f"/v1/files/{ended['error_file_id']}/content").content.splitlines()]
              if ended["error_file_id"] else [])
    ids = [row["custom_id"] for row in outputs + errors]
    assert sorted(ids) == sorted(f"{tag}-{i}" for i in range(n)), "a line is missing or repeated"
    assert len(ids) == len(set(ids)) == n
    counts = ended["request_counts"]
    assert counts == {"total": n, "completed": len(outputs), "failed": len(errors)}
    assert [o["custom_id"] for o in outputs] == sorted((o["custom_id"] for o in outputs),
                                                       key=lambda c: int(c.rsplit("-", 1)[1]))  # line order
    assert errors == [], f"lines failed: {errors[:3]}"
    job_ids = [o["response"]["request_id"] for o in outputs]
    assert len(set(job_ids)) == n
    assert sorted(_tenant_jobs_with(api, tag)) == sorted(job_ids), "a line made a second job"
    runs = sum(sum(faults.engine_starts(job_id).values()) for job_id in job_ids)
    duplicated = sum(n_ - 1 for job_id in job_ids for n_ in faults.engine_starts(job_id).values() if n_ > 1)
    assert duplicated == 0
    print(f"\nFAULT-TABLE | batch of {n} lines, {len(kills_at)} x SIGKILL of results+ar workers, API and Redis | "
          f"completed {len(outputs)} | failed {len(errors)} | duplicated {duplicated} | engine runs {runs} | "
          f"took {took:.1f}s")


def test_a_batch_survives_sigkill_of_its_workers_the_api_and_redis(faults: FaultSystem, api: httpx.Client) -> None:
    run_batch_under_kills(faults, api, 60, kills_at=(0.2, 0.6))


@pytest.mark.chaos
def test_a_1000_line_batch_survives_sigkill_of_everything(faults: FaultSystem, api: httpx.Client) -> None:
    run_batch_under_kills(faults, api, 1000, kills_at=(0.1, 0.4, 0.8))
