"""Batched stage workers: concurrent jobs in one process share vLLM / diffusers calls (real engines,
real Redis), and each job still gets its own result, its own seed, its own error, its own cancel.

Threads here stand in for the Celery threads pool of a stage worker (-P threads -c N): each runs
StageRunner.run for one job's step, taken from the outbox, as the pool's threads do (one process,
so one lease owner for all of them).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import yaml
from PIL import Image

from omni_jobs.accept.submission import JobSubmitter
from omni_jobs.artifacts import ArtifactStore, LocalBackend, RedisBackend
from omni_jobs.dispatch.cancellation import cancel_job
from omni_jobs.engines.ar import ARRequest, SamplingOptions
from omni_jobs.engines.batching import BatchDefaults, ar_batcher, dit_batcher
from omni_jobs.engines.dit import DiTRequest
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import EventType, Job, JobStatus, StageStatus
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import AssembleResults, RunStage, Step, StepOutcome
from omni_jobs.pipelines.catalogue import PipelineCatalogue, parse_pipeline
from omni_jobs.run.stage_reports import Reporting
from omni_jobs.run.stages import StageRunner
from tests.outbox import due_steps

PIPELINES = list(yaml.safe_load_all("""
name: batch-text
inputs: {prompt: {type: text, max_length: 8000}}
stages:
  - id: ar
    engine: ar
    model: tiny:llama
    inputs: {prompt: input.prompt}
    batching: {max_batch_size: 8, wait_ms: 300}
    defaults: {max_tokens: 12, temperature: 0.0}
outputs: [{name: text, from: ar.text}]
---
name: batch-image
inputs: {prompt: {type: text}}
stages:
  - id: dit
    engine: dit
    model: tiny:pixart
    inputs: {prompt: input.prompt}
    engine_args: {pipeline_class: PixArtSigmaPipeline}
    batching: {max_batch_size: 8, wait_ms: 300}
    defaults: {height: 32, width: 32, num_inference_steps: 4, seed: 0}
outputs: [{name: image, from: dit.image}]
"""))


@pytest.fixture(scope="module")
def engine_cache() -> Any:
    """This module's own engines: a vLLM engine made here and dropped at the end of the module.

    (Dropping an LLM tears down vLLM's process-global parallel groups, so a session engine made
    before another module's engines are dropped stops working; its own cache keeps the session
    engine's life as it was before this module existed.)
    """
    from omni_jobs.engines.pool import EnginePool
    from tests.conftest import MODELS_DIR

    return EnginePool(MODELS_DIR, kv_cache_bytes=256 * 2**20, max_model_len=512, device="cpu")


@pytest.fixture
def parts(redis_client: redis.Redis, tmp_path: Path, engine_cache: Any) -> dict[str, Any]:
    catalogue = PipelineCatalogue([parse_pipeline(p, source="test") for p in PIPELINES])
    store = RedisJobStore(redis_client, ttl_s=600)
    ledger = JobLedger(store, lease_s=30.0)
    artifacts = ArtifactStore(LocalBackend(tmp_path), RedisBackend(redis_client))
    runner = StageRunner(ledger=ledger, catalogue=catalogue, artifacts=artifacts, engines=engine_cache,
                         reporting=Reporting(progress_interval_s=0), batching=BatchDefaults())
    ar_stage, dit_stage = catalogue.get("batch-text").stage("ar"), catalogue.get("batch-image").stage("dit")
    ar = engine_cache.ar(ar_stage.model, ar_stage.engine_args)
    dit = engine_cache.dit(dit_stage.model, dit_stage.engine_args)
    return {"store": store, "ledger": ledger, "runner": runner, "submit": JobSubmitter(ledger, catalogue),
            "artifacts": artifacts, "ar": ar, "dit": dit,
            "ar_batcher": ar_batcher(ar, BatchDefaults().policy(ar_stage)),
            "dit_batcher": dit_batcher(dit, BatchDefaults().policy(dit_stage))}


def dispatched(parts: dict[str, Any], job_id: str) -> list[Step]:
    """The job's due steps, taken from the outbox as the relay takes them."""
    return due_steps(parts["store"], job_id)


def first_step(parts: dict[str, Any], job: Job, stage: str) -> RunStage:
    (step,) = dispatched(parts, job.id)
    assert step == RunStage(job.id, stage, 1, stage)
    return step


def run(parts: dict[str, Any], step: RunStage) -> StepOutcome:
    outcome: StepOutcome = parts["runner"].run(step, worker="test", owner="test#1")
    return outcome


def run_all(parts: dict[str, Any], jobs: list[Job], stage: str) -> list[str]:
    """Run one stage of every job at once, one thread per job (a threads-pool worker)."""
    steps = [first_step(parts, j, stage) for j in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda s: run(parts, s).status, steps))


def output(parts: dict[str, Any], job_id: str, stage: str, port: str) -> bytes:
    ref = parts["ledger"].require(job_id).stage_record(stage).outputs[port]
    return parts["artifacts"].get(ref)  # type: ignore[no-any-return]


def progress_steps(parts: dict[str, Any], job_id: str) -> list[int]:
    return [e.data["step"] for e in parts["ledger"].events(job_id, count=10_000) if e.type is EventType.stage_progress]


def assert_next_steps(parts: dict[str, Any], jobs: list[Job], statuses: list[str]) -> None:
    """Each succeeded job dispatched its results step, once; a failed or canceled one dispatched
    nothing (no retry, no results); none holds a lease any more."""
    for job, status in zip(jobs, statuses, strict=True):
        expected = [AssembleResults(job.id, 1)] if status == "succeeded" else []
        assert dispatched(parts, job.id) == expected, (job.id, status)
    assert parts["store"].leased_slots() == []


def test_concurrent_ar_jobs_share_one_vllm_batch_and_each_gets_its_own_text(parts: dict[str, Any]) -> None:
    prompts = [f"story number {i} about a {w}" for i, w in enumerate(["cat", "dog", "fox", "owl", "bee", "elk"])]
    jobs = [parts["submit"].submit("batch-text", {"prompt": p}) for p in prompts]
    before = len(parts["ar_batcher"].batches)
    assert run_all(parts, jobs, "ar") == ["succeeded"] * len(jobs)
    assert_next_steps(parts, jobs, ["succeeded"] * len(jobs))
    sizes = parts["ar_batcher"].batches[before:]  # negative: requests that joined a running batch
    assert sum(abs(s) for s in sizes) == len(jobs) and max(sizes) > 1, f"jobs were not batched: {sizes}"
    # Greedy decoding: each job's text is exactly what a call with its prompt alone gives.
    alone = parts["ar"].generate([ARRequest(f"solo-{i}", p, SamplingOptions(max_tokens=12))
                                  for i, p in enumerate(prompts)])
    import json

    texts = [json.loads(output(parts, j.id, "ar", "text")) for j in jobs]
    texts = [t["text"] if isinstance(t, dict) else t for t in texts]
    assert texts == [a.text for a in alone]
    assert len(set(texts)) > 1


def test_ar_requests_arriving_mid_batch_join_it_and_return_early(parts: dict[str, Any]) -> None:
    long_job = parts["submit"].submit("batch-text", {"prompt": "long"}, {"ar": {"max_tokens": 300}})
    short = [parts["submit"].submit("batch-text", {"prompt": f"short {i}"}, {"ar": {"max_tokens": 4}})
             for i in range(3)]
    long_step, short_steps = first_step(parts, long_job, "ar"), [first_step(parts, j, "ar") for j in short]
    before = len(parts["ar_batcher"].batches)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(run, parts, long_step)
        deadline = time.monotonic() + 60
        while not progress_steps(parts, long_job.id):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        later = [pool.submit(run, parts, s) for s in short_steps]
        assert [f.result(60).status for f in later] == ["succeeded"] * 3
        assert not first.done(), "the short jobs waited for the long one's batch to end"
        assert first.result(60).status == "succeeded"
    sizes = parts["ar_batcher"].batches[before:]
    assert sizes[0] == 1 and any(s < 0 for s in sizes[1:]), f"nobody joined the running batch: {sizes}"
    assert_next_steps(parts, [long_job, *short], ["succeeded"] * 4)


def test_one_bad_ar_request_fails_alone(parts: dict[str, Any]) -> None:
    too_long = " ".join(f"w{i}" for i in range(1500))  # far more tokens than max_model_len
    jobs = [parts["submit"].submit("batch-text", {"prompt": p}) for p in ["fine one", too_long, "fine two"]]
    assert run_all(parts, jobs, "ar") == ["succeeded", "failed", "succeeded"]
    failed = parts["ledger"].require(jobs[1].id)
    assert failed.status is JobStatus.failed and failed.error is not None
    assert failed.error.stage == "ar" and "max_model_len" in failed.error.message
    assert failed.error.type == "StageError" and failed.stage_record("ar").attempts == 1  # not retried
    assert [parts["ledger"].require(j.id).status for j in jobs] == [JobStatus.running, JobStatus.failed,
                                                                     JobStatus.running]
    assert_next_steps(parts, jobs, ["succeeded", "failed", "succeeded"])


def test_canceling_one_ar_member_does_not_cancel_its_batch_mates(parts: dict[str, Any]) -> None:
    params = {"ar": {"max_tokens": 300, "temperature": 1.0, "seed": 5}}
    jobs = [parts["submit"].submit("batch-text", {"prompt": f"tell {i}"}, params) for i in range(3)]
    ledger = parts["ledger"]

    def cancel_when_running() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if progress_steps(parts, jobs[1].id):
                cancel_job(ledger, jobs[1].id)
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=cancel_when_running, daemon=True)
    watcher.start()
    assert run_all(parts, jobs, "ar") == ["succeeded", "canceled", "succeeded"]
    watcher.join(5)
    steps = progress_steps(parts, jobs[1].id)
    assert steps and max(steps) < 300
    assert [ledger.require(j.id).stage_record("ar").status for j in jobs] == [
        StageStatus.succeeded, StageStatus.canceled, StageStatus.succeeded]
    assert ledger.require(jobs[1].id).status is JobStatus.canceled
    assert_next_steps(parts, jobs, ["succeeded", "canceled", "succeeded"])


def pixels(data: bytes) -> np.ndarray:
    import io

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


def test_concurrent_dit_jobs_batch_and_honour_each_seed(parts: dict[str, Any]) -> None:
    seeds = [11, 12, 13, 14]
    jobs = [parts["submit"].submit("batch-image", {"prompt": f"a red {i}"}, {"dit": {"seed": s}})
            for i, s in enumerate(seeds)]
    before = len(parts["dit_batcher"].batches)
    assert run_all(parts, jobs, "dit") == ["succeeded"] * 4
    assert_next_steps(parts, jobs, ["succeeded"] * 4)
    sizes = parts["dit_batcher"].batches[before:]
    assert sum(sizes) == 4 and max(sizes) > 1, f"jobs were not batched: {sizes}"
    images = [pixels(output(parts, j.id, "dit", "image")) for j in jobs]
    for i, (job, seed) in enumerate(zip(jobs, seeds, strict=True)):
        (single,) = parts["dit"].generate([DiTRequest(job.id, prompt=f"a red {i}", height=32, width=32,
                                                      num_inference_steps=4, seed=seed)])
        diff = np.abs(images[i] - np.asarray(single.image.convert("RGB"), dtype=np.int16))
        assert diff.max() <= 1, f"job {i}: batched image differs from its single call by {diff.max()}/255"
    assert not np.array_equal(images[0], images[1])  # different seeds, different images


def test_same_dit_batch_composition_gives_identical_bytes(parts: dict[str, Any]) -> None:
    def batch() -> list[bytes]:
        jobs = [parts["submit"].submit("batch-image", {"prompt": f"blue {i}"}, {"dit": {"seed": i}}) for i in range(3)]
        before = len(parts["dit_batcher"].batches)
        assert run_all(parts, jobs, "dit") == ["succeeded"] * 3
        assert parts["dit_batcher"].batches[before:] == [3]
        return [output(parts, j.id, "dit", "image") for j in jobs]

    assert batch() == batch()


def test_incompatible_dit_sizes_do_not_share_a_call(parts: dict[str, Any]) -> None:
    jobs = [parts["submit"].submit("batch-image", {"prompt": "mixed"}, {"dit": {"height": h, "width": h}})
            for h in (32, 48, 32, 48)]
    before = len(parts["dit_batcher"].batches)
    assert run_all(parts, jobs, "dit") == ["succeeded"] * 4
    assert sorted(parts["dit_batcher"].batches[before:]) == [2, 2]
    sizes = [Image.open(__import__("io").BytesIO(output(parts, j.id, "dit", "image"))).size for j in jobs]
    assert sizes == [(32, 32), (48, 48), (32, 32), (48, 48)]


def test_canceling_one_dit_member_does_not_cancel_its_batch_mates(parts: dict[str, Any]) -> None:
    params = {"dit": {"num_inference_steps": 60, "height": 64, "width": 64}}
    jobs = [parts["submit"].submit("batch-image", {"prompt": f"slow {i}"}, params) for i in range(3)]
    ledger = parts["ledger"]

    def cancel_when_running() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if progress_steps(parts, jobs[0].id):
                cancel_job(ledger, jobs[0].id)
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=cancel_when_running, daemon=True)
    watcher.start()
    assert run_all(parts, jobs, "dit") == ["canceled", "succeeded", "succeeded"]
    watcher.join(5)
    assert [ledger.require(j.id).stage_record("dit").status for j in jobs] == [
        StageStatus.canceled, StageStatus.succeeded, StageStatus.succeeded]
    assert ledger.require(jobs[0].id).status is JobStatus.canceled
    assert max(progress_steps(parts, jobs[0].id)) < 60
    assert_next_steps(parts, jobs, ["canceled", "succeeded", "succeeded"])


def test_a_dit_batch_fills_with_the_tasks_its_worker_already_received(parts: dict[str, Any]) -> None:
    """Batch filling (omni_jobs.engines.batching.Arrivals, as workers/tasks.py wires it): tasks received at
    once but reaching the batcher one after another, past the 300 ms window, still share one call."""
    from omni_jobs.engines.batching import arrivals

    jobs = [parts["submit"].submit("batch-image", {"prompt": f"fill {i}"}) for i in range(3)]
    steps = [first_step(parts, j, "dit") for j in jobs]
    delays = [0.0, 0.6, 0.9]
    for s in steps:
        arrivals.received(s.job_id)

    def task(i: int) -> str:
        with arrivals.task(steps[i].job_id):
            time.sleep(delays[i])  # this task's own work before its engine call, slower than the window
            return run(parts, steps[i]).status

    before = len(parts["dit_batcher"].batches)
    arrivals.configure(5_000)
    try:
        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(task, range(3))) == ["succeeded"] * 3
    finally:
        arrivals.configure(0)
    assert parts["dit_batcher"].batches[before:] == [3]
    assert arrivals.arriving() == 0
    assert_next_steps(parts, jobs, ["succeeded"] * 3)
