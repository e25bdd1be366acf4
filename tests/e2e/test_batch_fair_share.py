"""Fair share down to the batch: a DiT worker's batches follow the tenants' turns, not arrival alone.

A system of its own: Redis DB 12, the API, one DiT worker and the results worker, real processes. The
DiT stage runs on the GPU-shaped engine (omni_jobs.engines.gpu_shaped: a batch's time mostly sleeps
with the interpreter's lock released, so batches take a known time on any machine) in batches of 32,
the worker running 32 jobs at once (one batch's worth). Which batch a job rode is read from when its
engine call returned (a batch's members return together; their commits then spread out).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis
import yaml

from omni_jobs.core.settings import Settings
from omni_jobs.local.devservices import RunningService, free_port
from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.conftest import auth_headers, models_dir
from tests.e2e.helpers import wait_for_job

FAIR_SHARE_DB = 12  # apart from 0 (flushed by other tests), 3 (e2e), 5 (ui), 6-10 (integration, fuzz), 11
BATCH = 32
MS_PER_IMAGE = 40.0
"""A full batch takes 32 x 40 ms = 1.3 s, one of 1 0.25 s (GpuShapedArgs.fixed_share)."""
SAME_BATCH_S = 0.2
"""Engine ends closer than this are one batch's (two batches' are a batch's run apart, 0.25 s at least). An end is
rebuilt from a member's start and its engine time, so one batch's spread by up to ~0.1 s on a loaded host and
more: one member of B's last batch counted as ahead of it failed a fresh-clone run at 0.1."""
PIPELINE = {
    "name": "gpu-image",
    "inputs": {"prompt": {"type": "text"}},
    "stages": [{"id": "dit", "engine": "dit", "model": "gpu-shaped", "queue": "dit", "inputs": {"prompt": "input.prompt"},
                "engine_args": {"kind": "gpu-shaped", "ms_per_image": MS_PER_IMAGE, "batch_size": BATCH},
                "batching": {"max_batch_size": BATCH, "wait_ms": 20, "max_in_flight": BATCH},
                "defaults": {"height": 32, "width": 32, "num_inference_steps": 4, "seed": 0}}],
    "outputs": [{"name": "image", "from": "dit.image"}],
}


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_service: RunningService) -> Iterator[EmbeddedSystem]:
    home = tmp_path_factory.mktemp("fair-share")
    pipelines = home / "pipelines"
    pipelines.mkdir()
    (pipelines / "gpu-image.yaml").write_text(yaml.safe_dump(PIPELINE))
    redis_url = f"redis://127.0.0.1:{redis_service.port}/{FAIR_SHARE_DB}"
    redis.Redis.from_url(redis_url).flushdb()
    system = EmbeddedSystem(
        settings=Settings(models_dir=models_dir(), artifacts_dir=home / "artifacts", redis_url=redis_url),
        home=home, api_port=free_port(), redis_url=redis_url, with_flower=False,
        worker_queues={"dit": "threads", "results": "solo"},
        extra_env={"OMNI_PIPELINES_PATH": json.dumps([str(pipelines)]),
                   "OMNI_STAGE_MAX_IN_FLIGHT": str(BATCH),  # the DiT worker's threads (-c)
                   "OMNI_PRELOAD_ENGINES": "false"},  # its first task loads the one engine it needs (in its engine process)
    )
    try:
        system.start(say=lambda _msg: None)
        yield system
    finally:
        system.stop()


def client_for(system: EmbeddedSystem, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=system.api_url, timeout=30, headers=auth_headers(system.create_api_key(tenant)))


def post_many(api: httpx.Client, prefix: str, n: int) -> list[str]:
    def post(i: int) -> str:
        response = api.post("/v1/jobs", json={"pipeline": "gpu-image", "input": {"prompt": f"{prefix} {i}"}})
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(post, range(n)))


def finished(api: httpx.Client, ids: list[str]) -> list[dict[str, Any]]:
    jobs = [wait_for_job(api, job_id, timeout_s=300) for job_id in ids]
    assert [j["status"] for j in jobs] == ["succeeded"] * len(jobs), [j["error"] for j in jobs if j["error"]]
    return jobs


def engine_ends(jobs: list[dict[str, Any]]) -> dict[str, float]:
    """When each job's DiT engine call returned: the members of one batch return together, a batch's
    commits then spread over a few hundred ms (their order is the threads', not the batch's)."""
    return {j["id"]: j["stages"][0]["started_at"] + j["stages"][0]["metrics"]["engine_s"] for j in jobs}


def dit_batch_sizes(system: EmbeddedSystem) -> dict[str, float]:
    """The DiT worker's omni_jobs_engine_batch_size histogram: bucket (le) -> batches so far."""
    text = httpx.get(f"http://127.0.0.1:{system.metrics_ports['dit']}/metrics", timeout=10).text
    found = {}
    for line in text.splitlines():
        if line.startswith("omni_jobs_engine_batch_size_bucket{") and 'engine="dit"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            found[le] = float(line.rsplit(" ", 1)[1])
    return found


def test_one_tenants_burst_forms_full_batches(system: EmbeddedSystem) -> None:
    before = dit_batch_sizes(system)
    with client_for(system, "tenant-alone") as alone:
        finished(alone, post_many(alone, "alone", 3 * BATCH))
    after = dit_batch_sizes(system)
    ran = {le: after[le] - before.get(le, 0.0) for le in after}
    print(f"one tenant's batches, by size bucket: {ran}")
    assert ran["+Inf"] <= 6 and ran["+Inf"] - ran["16.0"] >= 2, ran  # 96 jobs: 3 batches of 32 at best


def test_another_tenants_jobs_ride_the_next_batch(system: EmbeddedSystem) -> None:
    with client_for(system, "tenant-a") as a, client_for(system, "tenant-b") as b:
        a_ids = post_many(a, "a", 160)
        b_ids = post_many(b, "b", 3)
        b_jobs = finished(b, b_ids)
        a_jobs = finished(a, a_ids)
    b_posted = max(j["created_at"] for j in b_jobs)
    finished_at = {j["id"]: j["stages"][0]["finished_at"] for j in [*a_jobs, *b_jobs]}
    a_first = sum(b_posted < finished_at[i] < min(finished_at[b] for b in b_ids) for i in a_ids)
    ends = engine_ends([*a_jobs, *b_jobs])
    last_b = max(ends[i] for i in b_ids)
    a_ahead = sum(b_posted < ends[i] < last_b - SAME_BATCH_S for i in a_ids)
    print(f"after B's posts: {a_ahead} of A's jobs ran before B's last batch, {a_first} finished before B's first")
    assert a_ahead <= BATCH, f"{a_ahead} of A's jobs ran after B's posts and before B's last batch"
