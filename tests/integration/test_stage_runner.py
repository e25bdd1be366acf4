"""The stage runner in-process on real Redis and real engines: cancel, deadlines, time limits, redelivery.

The dispatcher here is the in-process transport: it only collects the next steps, so each test
decides when the next stage runs.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from omni_jobs.artifacts import ArtifactStore, LocalBackend, RedisBackend
from omni_jobs.dispatch import NextStep
from omni_jobs.errors import IdempotencyConflict
from omni_jobs.jobs.models import JobStatus, StageStatus
from omni_jobs.jobs.store import JobStore
from omni_jobs.pipelines.catalogue import PipelineCatalogue, builtin_pipelines, parse_pipeline
from omni_jobs.results import ResultsAssembler
from omni_jobs.stages import StageLimits, StageRunner
from omni_jobs.submission import JobSubmitter

SLOW_DIT = yaml.safe_load("""
name: slow-image
inputs: {prompt: {type: text}}
stages:
  - id: dit
    engine: dit
    model: tiny:pixart
    inputs: {prompt: input.prompt}
    engine_args: {pipeline_class: PixArtSigmaPipeline}
    defaults: {height: 256, width: 256, num_inference_steps: 200, seed: 1}
outputs: [{name: image, from: dit.image}]
""")
TOO_SLOW_DIT = {**SLOW_DIT, "name": "too-slow-image",
                "stages": [{**SLOW_DIT["stages"][0], "soft_time_limit_s": 0.6}]}


class Collect:
    """In-process dispatcher: remembers what should run next."""

    def __init__(self) -> None:
        self.steps: list[NextStep] = []

    def dispatch(self, step: NextStep) -> None:
        self.steps.append(step)


@pytest.fixture
def parts(redis_client: redis.Redis, tmp_path: Path, engine_cache: Any) -> dict[str, Any]:
    catalogue = PipelineCatalogue([*builtin_pipelines(), parse_pipeline(SLOW_DIT, source="test"),
                                   parse_pipeline(TOO_SLOW_DIT, source="test")])
    slow = catalogue.get("slow-image").stage("dit")
    engine_cache.dit(slow.model, slow.engine_args)  # loaded beforehand: limits and deadlines count the work only
    store = JobStore(redis_client, ttl_s=600)
    artifacts = ArtifactStore(LocalBackend(tmp_path), RedisBackend(redis_client))
    runner = StageRunner(store=store, catalogue=catalogue, artifacts=artifacts, engines=engine_cache,
                         limits=StageLimits(progress_interval_s=0))
    collect = Collect()
    submitter = JobSubmitter(store, catalogue, collect)
    results = ResultsAssembler(store=store, catalogue=catalogue, artifacts=artifacts)
    return {"store": store, "runner": runner, "submit": submitter, "dispatch": collect, "results": results}


def cancel_on_first_progress(store: JobStore, job_id: str) -> threading.Thread:
    """Watch the job's event stream like a client would, and cancel at the first progress event."""
    from omni_jobs.cancellation import cancel_job

    def watch() -> None:
        last = "0-0"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for event in store.events(job_id, after=last, block_ms=200):
                last = event.id
                if event.type == "stage.progress":
                    cancel_job(store, job_id)
                    return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_cancel_stops_an_ar_stage_at_the_next_token(parts: dict[str, Any]) -> None:
    store, runner = parts["store"], parts["runner"]
    job = parts["submit"].submit("text-to-text", {"prompt": "count"}, {"ar": {"max_tokens": 400, "temperature": 1.0,
                                                                             "seed": 3}})
    watcher = cancel_on_first_progress(store, job.id)
    outcome = runner.run(job.id, "ar", worker="test")
    watcher.join(5)
    final = store.require(job.id)
    assert outcome.status == "canceled" and outcome.next_steps == []
    assert final.status is JobStatus.canceled and final.stage_record("ar").status is StageStatus.canceled
    progress = [e for e in store.events(job.id) if e.type == "stage.progress"]
    assert progress and progress[-1].data["step"] < 400  # stopped early, not after generating everything
    # The engine is still usable: the next job on it runs to the end.
    ok = parts["submit"].submit("text-to-text", {"prompt": "again"}, {"ar": {"max_tokens": 4}})
    assert runner.run(ok.id, "ar", worker="test").status == "succeeded"


def test_cancel_stops_a_dit_stage_at_the_next_step(parts: dict[str, Any]) -> None:
    store, runner = parts["store"], parts["runner"]
    job = parts["submit"].submit("slow-image", {"prompt": "slow"}, {"dit": {"num_inference_steps": 200}})
    watcher = cancel_on_first_progress(store, job.id)
    assert runner.run(job.id, "dit", worker="test").status == "canceled"
    watcher.join(5)
    steps = [e.data["step"] for e in store.events(job.id) if e.type == "stage.progress"]
    assert steps and max(steps) < 200
    assert store.require(job.id).status is JobStatus.canceled


def test_soft_time_limit_fails_the_job_with_a_clear_reason(parts: dict[str, Any]) -> None:
    store, runner = parts["store"], parts["runner"]
    job = parts["submit"].submit("too-slow-image", {"prompt": "too slow"})
    started = time.monotonic()
    assert runner.run(job.id, "dit", worker="test").status == "failed"
    assert time.monotonic() - started < 20
    final = store.require(job.id)
    assert final.status is JobStatus.failed
    assert final.error is not None and final.error.stage == "dit" and final.error.type == "StageTimeout"
    assert "soft time limit of 0.6s" in final.error.message


def test_deadline_cancels_a_running_job(parts: dict[str, Any]) -> None:
    store, runner = parts["store"], parts["runner"]
    job = parts["submit"].submit("slow-image", {"prompt": "deadline"}, cancel_after_s=0.5)
    assert runner.run(job.id, "dit", worker="test").status == "canceled"
    final = store.require(job.id)
    assert final.status is JobStatus.canceled and final.deadline_at == pytest.approx(final.created_at + 0.5)
    assert store.events(job.id)[-1].data["reason"] == "deadline exceeded (cancel_after)"


def test_redelivered_stage_is_not_run_again_but_advances(parts: dict[str, Any]) -> None:
    store, runner, collect = parts["store"], parts["runner"], parts["dispatch"]
    job = parts["submit"].submit("text-to-image", {"prompt": "once"}, {"ar": {"max_tokens": 4},
                                                                     "dit": {"height": 32, "width": 32,
                                                                             "num_inference_steps": 2}})
    assert [s.stage_id for s in collect.steps] == ["ar"]
    first = runner.run(job.id, "ar", worker="w1")
    assert first.status == "succeeded" and [s.stage_id for s in first.next_steps] == ["dit"]
    outputs = store.require(job.id).stage_record("ar").outputs
    again = runner.run(job.id, "ar", worker="w2")  # the broker redelivered the message
    assert again.status == "skipped" and [s.stage_id for s in again.next_steps] == ["dit"]
    record = store.require(job.id).stage_record("ar")
    assert record.attempts == 1 and record.worker == "w1" and record.outputs == outputs
    assert runner.run(job.id, "dit", worker="w1").next_steps == [NextStep(job.id, None, "results")]
    assert runner.run(job.id, "dit", worker="w2").next_steps == [NextStep(job.id, None, "results")]
    done = parts["results"].assemble(job.id)
    assert done.status is JobStatus.succeeded
    again_done = parts["results"].assemble(job.id)  # results run once in effect
    assert again_done.completed_at == done.completed_at
    assert runner.run(job.id, "ar", worker="w3").status == "skipped"  # a finished job is never re-run


def test_idempotency_key_returns_the_same_job_or_conflicts(parts: dict[str, Any]) -> None:
    submit = parts["submit"]
    a, created_a = submit.submit_idempotent("text-to-text", {"prompt": "hi"}, None, idempotency_key="k-1")
    b, created_b = submit.submit_idempotent("text-to-text", {"prompt": "hi"}, None, idempotency_key="k-1")
    assert created_a and not created_b and a.id == b.id
    assert len(parts["dispatch"].steps) == 1  # the replay enqueued nothing
    with pytest.raises(IdempotencyConflict, match=a.id):
        submit.submit_idempotent("text-to-text", {"prompt": "other"}, None, idempotency_key="k-1")
