"""Faults injected into real processes: every accepted job reaches a final state, effects happen once.

Each test prints one line of the fault table (run with -s to see it): fault, jobs submitted,
succeeded, lost, duplicated, and the time from the fault to the last job finishing.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.e2e.helpers import submit, wait_for_job
from tests.fault.conftest import HARD_LIMIT_S, MAX_QUEUED, VISIBILITY_TIMEOUT_S, FaultSystem

FINAL = ("succeeded", "failed", "canceled")


def image_params(seed: int, steps: int = 30, size: int = 128) -> dict[str, Any]:
    return {"ar": {"max_tokens": 4}, "dit": {"height": size, "width": size, "num_inference_steps": steps, "seed": seed}}


def image_bytes(api: httpx.Client, job: dict[str, Any]) -> bytes:
    (image,) = [o for o in job["outputs"] if o["type"] == "image"]
    return api.get(f"/v1/jobs/{job['id']}/outputs/image").raise_for_status().content if image else b""


def pixels_close(a: bytes, b: bytes) -> bool:
    import io

    import numpy as np
    from PIL import Image

    pa, pb = (np.asarray(Image.open(io.BytesIO(x)).convert("RGB"), dtype=np.int16) for x in (a, b))
    return pa.shape == pb.shape and int(np.abs(pa - pb).max()) <= 1


def wait_until(predicate: Any, timeout_s: float = 60, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def report(fault: str, jobs: list[dict[str, Any]], duplicated: int, recovery_s: float) -> None:
    succeeded = sum(j["status"] == "succeeded" for j in jobs)
    lost = sum(j["status"] not in FINAL for j in jobs)
    print(f"\nFAULT-TABLE | {fault} | submitted {len(jobs)} | succeeded {succeeded} | lost {lost} | "
          f"duplicated {duplicated} | recovery {recovery_s:.1f}s")


def count_duplicates(api: httpx.Client, jobs: list[dict[str, Any]]) -> int:
    """A job 'duplicated' if it has more than one image output, or its image differs from a clean re-run."""
    dupes = 0
    for job in jobs:
        images = [o for o in job["outputs"] if o["type"] == "image"]
        if len(images) != 1:
            dupes += 1
    return dupes


def test_sigkill_dit_worker_mid_stage(faults: FaultSystem, api: httpx.Client) -> None:
    jobs = [submit(api, "text-to-image", f"kill test {i}", image_params(seed=i)) for i in range(4)]

    def running_dit() -> str | None:
        for j in jobs:
            job = api.get(f"/v1/jobs/{j['id']}").json()
            if job["stage"] == "dit" and job["progress"] and job["progress"]["step"] >= 1:
                return str(job["id"])
        return None

    victim = wait_until(running_dit, what="a DiT stage in progress")
    worker = faults.process("worker-dit")
    worker.kill()  # SIGKILL: no cleanup, the task stays unacknowledged in the broker
    killed_at = time.time()
    worker.start()
    done = [wait_for_job(api, j["id"], timeout_s=180) for j in jobs]
    assert [d["status"] for d in done] == ["succeeded"] * 4, [d["error"] for d in done]
    victim_job = next(d for d in done if d["id"] == victim)
    victim_dit = next(s for s in victim_job["stages"] if s["id"] == "dit")
    assert victim_dit["attempts"] >= 2  # it was redelivered
    assert victim_dit["started_at"] - killed_at >= VISIBILITY_TIMEOUT_S  # back through the broker, not by luck
    recovery = victim_job["completed_at"] - killed_at
    # Same seed, clean run: the redelivered job's image is the one a fault-free run makes.
    clean = wait_for_job(api, submit(api, "text-to-image", "kill test " + str(jobs.index(
        next(j for j in jobs if j["id"] == victim))), image_params(seed=jobs.index(
            next(j for j in jobs if j["id"] == victim))))["id"])
    # (within 1/255 per pixel: the stage worker batches, and batch composition moves the last bit)
    assert pixels_close(image_bytes(api, clean), image_bytes(api, victim_job))
    duplicated = count_duplicates(api, done)
    assert duplicated == 0
    report("SIGKILL DiT worker mid-stage", done, duplicated, recovery)


def test_sigkill_ar_worker_mid_stage(faults: FaultSystem, api: httpx.Client) -> None:
    params = {"ar": {"max_tokens": 400, "temperature": 1.0, "seed": 5}, "dit": {"height": 32, "width": 32,
                                                                              "num_inference_steps": 2}}
    jobs = [submit(api, "text-to-image", "ar kill", params) for _ in range(3)]

    def running_ar() -> bool:
        return any(api.get(f"/v1/jobs/{j['id']}").json()["stage"] == "ar" for j in jobs)

    wait_until(running_ar, what="an AR stage running")
    worker = faults.process("worker-ar")
    worker.kill()
    killed_at = time.time()
    worker.start()
    done = [wait_for_job(api, j["id"], timeout_s=180) for j in jobs]
    recovery = max(d["completed_at"] for d in done) - killed_at
    assert [d["status"] for d in done] == ["succeeded"] * 3, [d["error"] for d in done]
    texts = {next(o["text"] for o in d["outputs"] if o["type"] == "text") for d in done}
    assert len(texts) == 1  # same prompt template and seed: one text, whichever attempt made it
    duplicated = count_duplicates(api, done)
    assert duplicated == 0
    report("SIGKILL AR worker mid-stage", done, duplicated, recovery)


def test_redis_restart_with_aof_loses_no_accepted_job(faults: FaultSystem, api: httpx.Client) -> None:
    jobs = [submit(api, "text-to-image", f"redis restart {i}", image_params(seed=i, steps=10, size=64))
            for i in range(4)]
    faults.redis.stop()  # SIGTERM: Redis writes its AOF and exits
    stopped_at = time.monotonic()
    refused = api.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "while down"}})
    assert refused.status_code == 503 and refused.headers["retry-after"]
    time.sleep(1)
    faults.redis.start()
    done = [wait_for_job(api, j["id"], timeout_s=180) for j in jobs]
    recovery = time.monotonic() - stopped_at
    assert [d["status"] for d in done] == ["succeeded"] * 4, [d["error"] for d in done]
    duplicated = count_duplicates(api, done)
    assert duplicated == 0
    report("Redis restart (AOF) during a run", done, duplicated, recovery)


def test_s3_outage_is_retried_until_it_comes_back(faults: FaultSystem, api: httpx.Client) -> None:
    faults.s3.stop()
    stopped_at = time.monotonic()
    jobs = [submit(api, "text-to-image", f"s3 outage {i}", image_params(seed=i, steps=4, size=64)) for i in range(2)]
    wait_until(lambda: any(s["attempts"] >= 2 for j in jobs for s in api.get(f"/v1/jobs/{j['id']}").json()["stages"]),
               what="a stage retried while S3 is down")
    faults.s3.start()  # an empty S3 (moto keeps nothing): the bucket is created again on the next put
    done = [wait_for_job(api, j["id"], timeout_s=180) for j in jobs]
    recovery = time.monotonic() - stopped_at
    assert [d["status"] for d in done] == ["succeeded"] * 2, [d["error"] for d in done]
    assert max(s["attempts"] for d in done for s in d["stages"] if s["id"] == "dit") >= 2
    report("S3 unavailable ~seconds, then back", done, count_duplicates(api, done), recovery)


def test_s3_that_never_comes_back_fails_the_job_clearly(faults: FaultSystem, api: httpx.Client) -> None:
    faults.s3.stop()
    try:
        started = time.monotonic()
        job = wait_for_job(api, submit(api, "text-to-image", "s3 gone", image_params(seed=1, steps=2, size=64))["id"],
                           timeout_s=240)
        elapsed = time.monotonic() - started
    finally:
        faults.s3.start()
    assert job["status"] == "failed"
    assert job["error"]["stage"] == "dit" and job["error"]["type"] == "ArtifactStoreUnavailable"
    assert "s3" in job["error"]["message"]
    dit = next(s for s in job["stages"] if s["id"] == "dit")
    assert dit["attempts"] == 5  # the first try and OMNI_STAGE_MAX_RETRIES=4 retries with backoff
    report("S3 never comes back", [job], 0, elapsed)


def test_graceful_shutdown_finishes_what_the_worker_holds(faults: FaultSystem, api: httpx.Client) -> None:
    job = submit(api, "text-to-image", "graceful", image_params(seed=9, steps=60))
    wait_until(lambda: api.get(f"/v1/jobs/{job['id']}").json()["stage"] == "dit", what="the DiT stage to start")
    worker = faults.process("worker-dit")
    stopped_at = time.monotonic()
    worker.stop(timeout_s=60)  # SIGTERM: Celery's warm shutdown finishes the running task first
    done = wait_for_job(api, job["id"], timeout_s=5)
    worker.start()
    assert done["status"] == "succeeded"
    assert next(s for s in done["stages"] if s["id"] == "dit")["attempts"] == 1
    report("SIGTERM (graceful) DiT worker mid-stage", [done], 0, time.monotonic() - stopped_at)


def test_overload_answers_503_with_retry_after_and_drains(faults: FaultSystem, api: httpx.Client) -> None:
    worker = faults.process("worker-ar")
    worker.stop(timeout_s=60)  # nobody consumes the 'ar' queue: accepted jobs pile up
    try:
        accepted = [submit(api, "text-to-text", f"queued {i}", {"ar": {"max_tokens": 2}}) for i in range(MAX_QUEUED)]
        refused = api.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "one too many"}})
        assert refused.status_code == 503
        assert int(refused.headers["retry-after"]) > 0
        assert "queue 'ar' is full" in refused.json()["detail"]
        assert [api.get(f"/v1/jobs/{j['id']}").json()["status"] for j in accepted] == ["queued"] * MAX_QUEUED
    finally:
        worker.start()
    started = time.monotonic()
    done = [wait_for_job(api, j["id"]) for j in accepted]
    assert [d["status"] for d in done] == ["succeeded"] * MAX_QUEUED
    assert submit(api, "text-to-text", "room again", {"ar": {"max_tokens": 2}})["status"] == "queued"
    report("Overload (queue full)", done, 0, time.monotonic() - started)


def test_hard_time_limit_fails_the_job_and_replaces_the_worker(faults: FaultSystem, api: httpx.Client) -> None:
    worker = faults.process("worker-dit")
    pid = worker.pid
    started = time.monotonic()
    job = wait_for_job(api, submit(api, "hard-limit", "forever")["id"], timeout_s=120)
    assert job["status"] == "failed" and job["error"]["stage"] == "dit"
    assert job["error"]["type"] == "StageTimeout" and f"hard time limit of {HARD_LIMIT_S:g}s" in job["error"]["message"]
    wait_until(lambda: not worker.running or worker.pid != pid, timeout_s=30, what="the stuck worker to exit")
    assert f"hard time limit of {HARD_LIMIT_S:g}s reached: exiting this worker process" in worker.log_path.read_text()
    worker.start()  # what compose's restart policy (or `omni-jobs up`) does
    after = wait_for_job(api, submit(api, "text-to-image", "after the limit", image_params(seed=2, steps=2, size=32))["id"])
    assert after["status"] == "succeeded"
    # The redelivered message found the job final and did nothing: it stays failed, attempts 1.
    time.sleep(VISIBILITY_TIMEOUT_S + 2)
    again = api.get(f"/v1/jobs/{job['id']}").json()
    assert again["status"] == "failed" and again["stages"][0]["attempts"] == 1
    report("Stage past its hard time limit", [job], 0, time.monotonic() - started)
