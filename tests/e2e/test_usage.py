"""GET /v1/usage against the real system: what a tenant's jobs used, counted by the workers and the API as
they commit (jobs by status, stage-seconds per queue, tokens, images), each tenant seeing its own and an
admin's key (OMNI_ADMIN_TENANTS) every tenant's."""

from __future__ import annotations

import time
from typing import Any

import httpx

from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.conftest import auth_headers
from tests.e2e.helpers import wait_for_job


def today(api: httpx.Client, **params: str) -> dict[str, Any]:
    start = str(int(time.time() // 86400 * 86400))
    answer = api.get("/v1/usage", params={"start": start, **params})
    assert answer.status_code == 200, answer.text
    (bucket,) = answer.json()["data"]
    return {r["tenant"]: r for r in bucket["results"]}


def test_usage_counts_a_tenants_jobs(system: EmbeddedSystem) -> None:
    tenant = f"usage-{time.time_ns()}"
    headers = auth_headers(system.create_api_key(tenant))
    with httpx.Client(base_url=system.api_url, timeout=60, headers=headers) as api:
        assert today(api) == {}
        jobs = [api.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "count me"},
                                           "params": {"ar": {"max_tokens": 5}}}).json(),
                api.post("/v1/jobs", json={"pipeline": "dit-only", "input": {"prompt": "a fox"}}).json()]
        done = [wait_for_job(api, job["id"]) for job in jobs]
        assert [d["status"] for d in done] == ["succeeded", "succeeded"]
        deadline = time.monotonic() + 10
        while (mine := today(api).get(tenant, {})).get("jobs", {}).get("succeeded") != 2:
            assert time.monotonic() < deadline, mine
            time.sleep(0.2)
        assert mine["jobs"] == {"queued": 2, "succeeded": 2}
        assert set(mine["stage_seconds"]) == {"ar", "dit"} and all(v > 0 for v in mine["stage_seconds"].values())
        ar = done[0]["stages"][0]
        assert mine["stage_seconds"]["ar"] == round(ar["finished_at"] - ar["started_at"], 3)
        assert mine["tokens"]["output"] == 5 and mine["tokens"]["input"] > 0
        assert mine["images"] == 1 and mine["audio_seconds"] == 0 and mine["video_frames"] == 0
        other = api.get("/v1/usage", params={"start": 1767225600, "tenant": "demo"})
        assert other.status_code == 403 and other.json()["error"]["param"] == "tenant"
        backwards = api.get("/v1/usage", params={"start": 1767225600, "end": 1767225600})
        assert backwards.status_code == 400 and backwards.json()["error"]["param"] == "end"
        assert api.get("/v1/usage", params={"start": "2026-01-01"}).status_code == 422  # Unix seconds, as OpenAI's
    with httpx.Client(base_url=system.api_url, timeout=60, headers=auth_headers(system.create_api_key("ops"))) as ops:
        everyone = today(ops)
        assert everyone[tenant] == mine
        assert set(today(ops, tenant=tenant)) == {tenant}
