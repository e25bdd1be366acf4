"""Faults injected into real processes, one window at a time: every accepted job ends, and every
effect happens once, counted from outside the job store.

Each test prints one line of the fault table (run with -s to see it): the fault, jobs submitted,
succeeded, lost, duplicated effects, and the time from the fault to recovery. Duplicates are
engine runs per stage attempt (the workers' run journal), output files per job (S3 listing) and
webhook ids per job and event (the receiver).
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.helpers import submit, wait_for_job
from tests.fault.conftest import BUCKET, HARD_LIMIT_S, MAX_QUEUED, FaultSystem
from tests.webhook_receiver import Received

FINAL = ("succeeded", "failed", "canceled")
LEASE_S = 15.0  # the default OMNI_LEASE_S
RECOVERY_BOUND_S = LEASE_S + 15  # lease, reaper passes, a busy 2-core machine


def image_params(seed: int, steps: int = 30, size: int = 128) -> dict[str, Any]:
    return {"ar": {"max_tokens": 4}, "dit": {"height": size, "width": size, "num_inference_steps": steps, "seed": seed}}


def image_bytes(api: httpx.Client, job: dict[str, Any]) -> bytes:
    return api.get(f"/v1/jobs/{job['id']}/outputs/image").raise_for_status().content


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


def duplicates(faults: FaultSystem, jobs: list[dict[str, Any]], outputs_per_job: int | None = None) -> int:
    """Effects that happened more than once: an engine run of one stage attempt, an output file."""
    dupes = 0
    for job in jobs:
        dupes += sum(n - 1 for n in faults.engine_starts(job["id"]).values() if n > 1)
        if outputs_per_job is not None and job["status"] == "succeeded":
            dupes += abs(len(faults.output_files(job["id"])) - outputs_per_job)
    return dupes


def webhook_ids(received: list[Received], job_id: str, event: str) -> set[str]:
    import json

    return {r.message_id for r in received if r.headers.get("omni-webhook-event") == event
            and json.loads(r.body)["id"] == job_id}


def report(fault: str, jobs: list[dict[str, Any]], duplicated: int, recovery_s: float) -> None:
    succeeded = sum(j["status"] == "succeeded" for j in jobs)
    lost = sum(j["status"] not in FINAL for j in jobs)
    print(f"\nFAULT-TABLE | {fault} | submitted {len(jobs)} | succeeded {succeeded} | lost {lost} | "
          f"duplicated {duplicated} | recovery {recovery_s:.1f}s")


def events_of(api: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    """The job's event history, from its SSE stream (it ends with the final event)."""
    import json

    events = []
    with api.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def running_dit(api: httpx.Client, jobs: list[dict[str, Any]]) -> str | None:
    """The id of one of ``jobs`` whose DiT stage has taken a step, if any."""
    for j in jobs:
        job = api.get(f"/v1/jobs/{j['id']}").json()
        if job["stage"] == "dit" and job["progress"] and job["progress"]["step"] >= 1:
            return str(job["id"])
    return None


# --- a worker dies mid-stage ---
def test_sigkill_dit_worker_mid_stage_and_restart_it_at_once(faults: FaultSystem, api: httpx.Client) -> None:
    jobs = [submit(api, "text-to-image", f"kill test {i}", image_params(seed=i)) for i in range(4)]

    victim = wait_until(lambda: running_dit(api, jobs), what="a DiT stage in progress")
    worker = faults.process("worker-dit")
    worker.kill()  # SIGKILL: no cleanup; the messages it held are gone from the broker (no copy is kept)
    killed_at = time.time()
    worker.start()  # what `omni-jobs up` or compose does: the new process takes back its predecessor's steps
    done = [wait_for_job(api, j["id"], timeout_s=180) for j in jobs]
    assert [d["status"] for d in done] == ["succeeded"] * 4, [d["error"] for d in done]
    victim_job = next(d for d in done if d["id"] == victim)
    victim_dit = next(s for s in victim_job["stages"] if s["id"] == "dit")
    assert victim_dit["attempts"] == 2  # the lost attempt and the one that finished, no more
    requeued = [e for e in events_of(api, victim) if e["type"] == "stage.requeued"]
    assert len(requeued) == 1 and "restarted without finishing it" in requeued[0]["data"]["reason"]
    assert victim_dit["started_at"] - killed_at < RECOVERY_BOUND_S  # the reaper, not a broker timeout
    # Same seed, clean run: the recovered job's image is the one a fault-free run makes.
    index = [j["id"] for j in jobs].index(victim)
    clean = wait_for_job(api, submit(api, "text-to-image", f"kill test {index}", image_params(seed=index))["id"])
    assert pixels_close(image_bytes(api, clean), image_bytes(api, victim_job))
    duplicated = duplicates(faults, done, outputs_per_job=2)
    assert duplicated == 0 and faults.engine_starts(victim)[(f"stage:{victim}:dit", 2)] == 1
    report("SIGKILL DiT worker mid-stage, restarted at once", done, duplicated, victim_job["completed_at"] - killed_at)


def test_sigkill_dit_worker_and_leave_it_dead_until_its_lease_expires(faults: FaultSystem, api: httpx.Client) -> None:
    job = submit(api, "text-to-image", "lease expiry", image_params(seed=3, steps=200, size=128))
    wait_until(lambda: (api.get(f"/v1/jobs/{job['id']}").json()["progress"] or {}).get("stage") == "dit",
               what="the DiT stage in progress")
    worker = faults.process("worker-dit")
    worker.kill()
    killed_at = time.monotonic()
    # No DiT worker now. The reaper (running in the other workers) must see the lease expire.
    wait_until(lambda: api.get(f"/v1/jobs/{job['id']}").json()["stages"][1]["status"] == "queued",
               timeout_s=RECOVERY_BOUND_S, what="the lost DiT attempt to be queued again")
    requeued_after = time.monotonic() - killed_at
    assert LEASE_S - 1 <= requeued_after < RECOVERY_BOUND_S
    worker.start()
    done = wait_for_job(api, job["id"], timeout_s=180)
    assert done["status"] == "succeeded" and done["stages"][1]["attempts"] == 2
    (requeued,) = [e for e in events_of(api, job["id"]) if e["type"] == "stage.requeued"]
    assert "lease expired" in requeued["data"]["reason"]
    duplicated = duplicates(faults, [done], outputs_per_job=2)
    assert duplicated == 0
    report("SIGKILL DiT worker, no restart (lease expiry)", [done], duplicated, requeued_after)


def test_sigkill_ar_worker_mid_stage(faults: FaultSystem, api: httpx.Client) -> None:
    params = {"ar": {"max_tokens": 400, "temperature": 1.0, "seed": 5}, "dit": {"height": 32, "width": 32,
                                                                              "num_inference_steps": 2}}
    jobs = [submit(api, "text-to-image", "ar kill", params) for _ in range(3)]
    wait_until(lambda: any(api.get(f"/v1/jobs/{j['id']}").json()["stage"] == "ar" for j in jobs),
               what="an AR stage running")
    worker = faults.process("worker-ar")
    worker.kill()
    killed_at = time.time()
    worker.start()
    done = [wait_for_job(api, j["id"], timeout_s=180) for j in jobs]
    recovery = max(d["completed_at"] for d in done) - killed_at
    assert [d["status"] for d in done] == ["succeeded"] * 3, [d["error"] for d in done]
    texts = {next(o["text"] for o in d["outputs"] if o["type"] == "text") for d in done}
    assert len(texts) == 1  # same prompt template and seed: one text, whichever attempt made it
    duplicated = duplicates(faults, done, outputs_per_job=2)
    assert duplicated == 0
    report("SIGKILL AR worker mid-stage", done, duplicated, recovery)


def test_sigkill_dit_worker_during_an_s3_upload(faults: FaultSystem, api: httpx.Client) -> None:
    """The last stage's worker uploads the job's image (results inline: the stage's own copy is that
    file) before the one write that records the stage and ends the job: killed mid-upload, nothing
    was recorded, and the stage runs again."""
    job = submit(api, "text-to-image", "upload kill", image_params(seed=4, steps=4, size=128))
    faults.gate.hold(rf"PUT /{BUCKET}/jobs/{job['id']}/outputs/image")
    assert faults.gate.wait_held(120), "the DiT stage never uploaded its image"
    worker = faults.process("worker-dit")
    worker.kill()  # the image is half-sent: the attempt never recorded it
    killed_at = time.time()
    faults.gate.release()
    worker.start()
    done = wait_for_job(api, job["id"], timeout_s=180)
    assert done["status"] == "succeeded" and done["stages"][1]["attempts"] == 2
    recorded = done["stages"][1]["outputs"]["image"]["key"]
    assert recorded == f"jobs/{job['id']}/outputs/dit.2/image.png"  # the whole file the second attempt wrote, under its keys
    duplicated = duplicates(faults, [done], outputs_per_job=2)
    assert duplicated == 0
    report("SIGKILL DiT worker during an S3 upload", [done], duplicated, done["completed_at"] - killed_at)


def test_sigkill_mid_assembly(faults: FaultSystem, api: httpx.Client) -> None:
    """The results are written inline by the last stage's worker (OMNI_RESULTS_INLINE), before the one
    write that records its stage and ends the job: killed while it uploads them, the stage runs again
    on its restarted node and writes them again, under keys of its own attempt (a stale attempt can then
    never replace them), and what the killed attempt uploaded is deleted once the job has succeeded;
    the completed webhook goes out once."""
    url = faults.receiver.script("/results-kill", [])
    response = api.post("/v1/jobs", json={"pipeline": "text-to-image", "input": {"prompt": "assembly kill"},
                                          "params": image_params(seed=6, steps=2, size=64),
                                          "webhook": url, "webhook_events_filter": ["completed"]})
    assert response.status_code == 202
    job = response.json()
    faults.gate.hold(rf"PUT /{BUCKET}/jobs/{job['id']}/outputs/text")  # the second file: the image may be up
    assert faults.gate.wait_held(120), "the results step never wrote an output"
    assert api.get(f"/v1/jobs/{job['id']}").json()["stages"][-1]["status"] == "running"  # nothing recorded yet
    worker = faults.process("worker-dit")  # the last stage's worker, assembling inline
    worker.kill()
    killed_at = time.time()
    faults.gate.release()
    worker.start()
    done = wait_for_job(api, job["id"], timeout_s=180)
    assert done["status"] == "succeeded" and {o["name"] for o in done["outputs"]} == {"image", "text"}
    assert done["stages"][-1]["attempts"] == 2
    kept = [f"jobs/{job['id']}/outputs/dit.2/image.png", f"jobs/{job['id']}/outputs/dit.2/text.json"]
    # the killed attempt's upload is deleted right after the write that ended the job, by the worker that made it
    wait_until(lambda: faults.output_files(job["id"]) == kept, timeout_s=15, what="only the recorded attempt's files")
    faults.receiver.wait_until(lambda: bool(faults.receiver.at("/results-kill")), what="the completed webhook")
    time.sleep(1)
    assert len(webhook_ids(faults.receiver.at("/results-kill"), job["id"], "completed")) == 1
    duplicated = duplicates(faults, [done], outputs_per_job=2)
    assert duplicated == 0
    report("SIGKILL the assembling worker mid-assembly", [done], duplicated, done["completed_at"] - killed_at)


def test_a_stage_longer_than_the_visibility_timeout_runs_once(faults: FaultSystem, api: httpx.Client) -> None:
    """The broker keeps no copy of a taken message to hand out again (no ack emulation), and the reaper's
    backlog bound (OMNI_VISIBILITY_TIMEOUT_S) only sends steps that have not started: one delivery."""
    env = {"OMNI_VISIBILITY_TIMEOUT_S": "2"}
    workers = [faults.system.start_worker("dit-long", name=f"dit-long-{i}", env=env, pool="solo") for i in (1, 2)]
    try:
        faults.system.wait_for_workers({"dit-long"})
        started = time.monotonic()
        job = wait_for_job(api, submit(api, "long-dit", "longer than the visibility timeout")["id"], timeout_s=240)
        took = time.monotonic() - started
    finally:
        for w in workers:
            w.stop(timeout_s=30)
            faults.system.processes.remove(w)
    assert job["status"] == "succeeded" and job["stages"][0]["attempts"] == 1
    task_id = f"stage:{job['id']}:dit:1"
    logs = "".join(w.log_path.read_text() for w in workers)
    assert took > 4, f"the stage took {took:.1f}s: not long enough to show anything"
    assert logs.count(f"[{task_id}] received") == 1, "the message was delivered again"
    assert faults.engine_starts(job["id"]) == {(f"stage:{job['id']}:dit", 1): 1}
    report("Stage past the visibility timeout (one delivery)", [job], 0, took)


# --- Redis and the broker ---
def test_redis_sigkill_right_after_the_202s_loses_no_accepted_job(faults: FaultSystem, api: httpx.Client) -> None:
    params = {"ar": {"max_tokens": 2}}

    def post(i: int) -> str | None:
        r = api.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": f"durable {i}"},
                                       "params": params})
        return str(r.json()["id"]) if r.status_code == 202 else None

    with ThreadPoolExecutor(8) as pool:
        accepted = [i for i in pool.map(post, range(40)) if i]
    faults.state.kill()  # SIGKILL right after the last 202: only what the AOF holds survives
    killed_at = time.monotonic()
    refused = api.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "while down"}})
    assert refused.status_code == 503 and refused.headers["retry-after"]
    time.sleep(2)
    faults.state.start()
    done = [wait_for_job(api, job_id, timeout_s=240) for job_id in accepted]
    assert len(accepted) == 40 and [d["status"] for d in done] == ["succeeded"] * 40, [d["error"] for d in done]
    duplicated = duplicates(faults, done, outputs_per_job=1)
    assert duplicated == 0
    report("Redis SIGKILL right after 40 x 202 (AOF always)", done, duplicated, time.monotonic() - killed_at)


def test_the_job_store_down_while_the_broker_is_up(faults: FaultSystem, api: httpx.Client) -> None:
    jobs = [submit(api, "text-to-image", f"store down {i}", image_params(seed=i, steps=20, size=64)) for i in range(4)]
    wait_until(lambda: any(api.get(f"/v1/jobs/{j['id']}").json()["status"] == "running" for j in jobs),
               what="a job running")
    faults.state.kill()  # workers hold messages from a broker that is fine; their writes find no store
    stopped_at = time.monotonic()
    time.sleep(5)
    faults.state.start()
    done = [wait_for_job(api, j["id"], timeout_s=240) for j in jobs]
    assert [d["status"] for d in done] == ["succeeded"] * 4, [d["error"] for d in done]
    duplicated = duplicates(faults, done, outputs_per_job=2)
    assert duplicated == 0
    report("Job store (Redis) down 5 s, broker up", done, duplicated, time.monotonic() - stopped_at)


def test_a_store_outage_longer_than_the_lease_takes_back_no_running_stage(faults: FaultSystem,
                                                                          api: httpx.Client) -> None:
    """Every lease lapses while Redis is away longer than the lease. Once it is back, the reaper gives the live
    workers a grace to renew theirs, instead of queueing a second attempt of each running stage (whose first
    would then lose its lease, or have its finished work refused)."""
    jobs = [submit(api, "text-to-image", f"long outage {i}", image_params(seed=i, steps=60, size=128))
            for i in range(2)]

    def dit_running() -> bool:
        return any(s["id"] == "dit" and s["status"] == "running"
                   for j in jobs for s in api.get(f"/v1/jobs/{j['id']}").json()["stages"])

    wait_until(dit_running, what="a DiT stage running")
    faults.state.kill()
    stopped_at = time.monotonic()
    time.sleep(LEASE_S + 3)
    faults.state.start()
    done = [wait_for_job(api, j["id"], timeout_s=240) for j in jobs]
    assert [d["status"] for d in done] == ["succeeded"] * 2, [d["error"] for d in done]
    attempts = {(d["id"], s["id"]): s["attempts"] for d in done for s in d["stages"]}
    assert set(attempts.values()) == {1}, attempts
    duplicated = duplicates(faults, done, outputs_per_job=2)
    assert duplicated == 0
    report(f"Job store (Redis) down {LEASE_S + 3:.0f} s, longer than the lease", done, duplicated,
           time.monotonic() - stopped_at)


def test_a_publish_that_fails_inside_submit_loses_nothing(faults: FaultSystem, api: httpx.Client) -> None:
    faults.broker.kill()  # the broker is gone: nothing can be published
    stopped_at = time.monotonic()
    try:
        accepted = [submit(api, "text-to-text", f"broker down {i}", {"ar": {"max_tokens": 2}}) for i in range(3)]
        time.sleep(1)
        assert [api.get(f"/v1/jobs/{j['id']}").json()["status"] for j in accepted] == ["queued"] * 3
    finally:
        faults.broker.start()
    done = [wait_for_job(api, j["id"], timeout_s=180) for j in accepted]
    assert [d["status"] for d in done] == ["succeeded"] * 3
    duplicated = duplicates(faults, done, outputs_per_job=1)
    assert duplicated == 0
    report("Broker down during submit (publish fails)", done, duplicated, time.monotonic() - stopped_at)


def test_a_crash_between_a_state_change_and_its_webhook_loses_no_webhook(faults: FaultSystem,
                                                                          api: httpx.Client) -> None:
    url = faults.receiver.script("/cancel-crash", [])
    response = api.post("/v1/jobs", json={"pipeline": "text-to-image", "input": {"prompt": "cancel crash"},
                                          "params": image_params(seed=1, steps=200, size=192),
                                          "webhook": url, "webhook_events_filter": ["completed"]})
    assert response.status_code == 202, response.text
    job = response.json()
    wait_until(lambda: api.get(f"/v1/jobs/{job['id']}").json()["status"] == "running", what="the job running")
    faults.broker.kill()  # the cancel's webhook cannot be published ...
    api.post(f"/v1/jobs/{job['id']}/cancel").raise_for_status()
    faults.process("api").kill()  # ... and the process that committed it dies
    crashed_at = time.monotonic()
    faults.broker.start()
    faults.system.supervise(say=lambda _msg: None)  # the API comes back
    faults.receiver.wait_until(lambda: bool(faults.receiver.at("/cancel-crash")), timeout_s=60,
                               what="the completed webhook")
    time.sleep(2)
    received = faults.receiver.at("/cancel-crash")
    assert len(webhook_ids(received, job["id"], "completed")) == 1
    import json

    assert {json.loads(r.body)["status"] for r in received} == {"canceled"}
    done = api.get(f"/v1/jobs/{job['id']}").json()
    assert done["status"] == "canceled"
    report("Crash between cancel and its webhook", [done], len(received) - 1, time.monotonic() - crashed_at)


# --- S3 ---
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
    retrying = [e for e in events_of(api, done[0]["id"]) if e["type"] == "stage.retrying"]
    assert retrying and all("ArtifactStoreUnavailable" in e["data"]["reason"] for e in retrying)
    report("S3 unavailable ~seconds, then back", done, duplicates(faults, done), recovery)


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


# --- shutdown, overload, time limits ---
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
        with ThreadPoolExecutor(8) as pool:
            accepted = list(pool.map(lambda i: submit(api, "text-to-text", f"queued {i}", {"ar": {"max_tokens": 2}}),
                                     range(MAX_QUEUED)))
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
    # The restarted worker took nothing back: the failed job's attempt is over, and stays so.
    again = api.get(f"/v1/jobs/{job['id']}").json()
    assert again["status"] == "failed" and again["stages"][0]["attempts"] == 1
    assert Counter(faults.engine_starts(job["id"]).values()) == Counter({1: 1})
    report("Stage past its hard time limit", [job], 0, time.monotonic() - started)


# --- a worker's engine process dies mid-batch ---
def engine_process(worker_pid: int, model: str) -> int:
    """The pid of the engine process that worker ``worker_pid`` (or a child of it) started for ``model`` (a
    model's name, or the last part of its path)."""
    def parent(pid: int) -> int:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])

    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"omni_jobs.engines.engine_process" not in argv:
                continue
            served = argv[argv.index(b"--model") + 1].decode()
            if served != model and not served.endswith(f"/{model}"):
                continue
            pid, ancestors = int(proc.name), []
            while pid > 1:
                pid = parent(pid)
                ancestors.append(pid)
        except (OSError, ValueError, IndexError):
            continue
        if worker_pid in ancestors:
            found.append(int(proc.name))
    assert len(found) == 1, f"engine processes of {model} under {worker_pid}: {found}"
    return found[0]


def test_sigkill_the_dit_engine_process_mid_stage_and_its_worker_runs_the_call_again(faults: FaultSystem,
                                                                                       api: httpx.Client) -> None:
    worker = faults.process("worker-dit")
    assert worker.pid is not None
    before = engine_process(worker.pid, "gpu-shaped")
    jobs = [submit(api, "gpu-image", f"engine kill {i}", {"dit": {"seed": i}}) for i in range(4)]

    victim = wait_until(lambda: running_dit(api, jobs), what="a DiT stage in progress")
    os.kill(before, signal.SIGKILL)  # the engine alone: its worker, its leases and its messages live on
    killed_at = time.time()
    done = [wait_for_job(api, j["id"], timeout_s=180) for j in jobs]
    assert [d["status"] for d in done] == ["succeeded"] * 4, [d["error"] for d in done]
    # The worker started a fresh engine process and sent it the requests again: no stage attempt was lost.
    assert [next(s for s in d["stages"] if s["id"] == "dit")["attempts"] for d in done] == [1] * 4
    after = engine_process(worker.pid, "gpu-shaped")
    assert after != before
    assert not [e for e in events_of(api, victim) if e["type"] == "stage.requeued"]
    victim_job = next(d for d in done if d["id"] == victim)
    index = [j["id"] for j in jobs].index(victim)
    clean = wait_for_job(api, submit(api, "gpu-image", f"engine kill {index}", {"dit": {"seed": index}})["id"])
    assert image_bytes(api, clean) == image_bytes(api, victim_job)  # the engine's images are exact
    assert not list(Path("/dev/shm").glob(f"omni-eng-{before}-*"))  # its unread blocks went with it
    duplicated = duplicates(faults, done, outputs_per_job=1)  # its one output, the image
    assert duplicated == 0
    report("SIGKILL the DiT engine process mid-stage", done, duplicated, victim_job["completed_at"] - killed_at)
