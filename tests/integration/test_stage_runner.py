"""The stage runner in-process on real Redis and real engines: cancel, deadlines, time limits,
redelivery, lost leases and transient errors.

No relay runs here: each test takes the dispatches from the outbox itself (as the relay would) and
decides when the next step runs, so it can also run a step twice, late, or out of turn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from omni_jobs.accept.submission import JobSubmitter
from omni_jobs.artifacts import ArtifactRef, ArtifactStore, ArtifactStoreUnavailable, LocalBackend, RedisBackend
from omni_jobs.core import keys
from omni_jobs.core.errors import IdempotencyConflict
from omni_jobs.dispatch.cancellation import cancel_job
from omni_jobs.jobs.followed import Readers
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import EventType, JobEvent, JobStatus, StageStatus, now
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import AssembleResults, RunStage, Step, step_id
from omni_jobs.jobs.watch import job_readers, mark_looked_at
from omni_jobs.pipelines.catalogue import PipelineCatalogue, builtin_pipelines, parse_pipeline
from omni_jobs.report.results import ResultsAssembler
from omni_jobs.run.stage_attempt import Retries
from omni_jobs.run.stage_reports import Reporting
from omni_jobs.run.stages import StageRunner
from tests.outbox import due_steps

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
MAX_ATTEMPTS = 3
BACKOFF_S = 10.0
"""First retry delay of the runner here: long enough that "due later" cannot be mistaken for "due now"."""


@pytest.fixture
def parts(outbox_redis: redis.Redis, tmp_path: Path, engine_cache: Any) -> dict[str, Any]:
    redis_client = outbox_redis  # apart from DB 0 (tests/conftest.py, OUTBOX_DB)
    catalogue = PipelineCatalogue([*builtin_pipelines(), parse_pipeline(SLOW_DIT, source="test"),
                                   parse_pipeline(TOO_SLOW_DIT, source="test")])
    slow = catalogue.get("slow-image").stage("dit")
    engine_cache.dit(slow.model, slow.engine_args)  # loaded beforehand: limits and deadlines count the work only
    store = RedisJobStore(redis_client, ttl_s=600)
    ledger = JobLedger(store, lease_s=30.0, max_attempts=MAX_ATTEMPTS)
    artifacts = ArtifactStore(LocalBackend(tmp_path), RedisBackend(redis_client))
    runner = StageRunner(ledger=ledger, catalogue=catalogue, artifacts=artifacts, engines=engine_cache,
                         reporting=Reporting(progress_interval_s=0), retries=Retries(backoff_s=BACKOFF_S))
    return {"redis": redis_client, "dir": tmp_path, "store": store, "ledger": ledger, "runner": runner, "artifacts": artifacts,
            "submit": JobSubmitter(ledger, catalogue, artifacts=artifacts),
            "results": ResultsAssembler(ledger=ledger, catalogue=catalogue, artifacts=artifacts)}


def dispatched(parts: dict[str, Any], job_id: str, *, at: float | None = None) -> list[Step]:
    """The job's steps due by ``at`` (now), taken from the outbox as the relay takes them."""
    return due_steps(parts["store"], job_id, at=at)


def events_of(parts: dict[str, Any], job_id: str, kind: EventType) -> list[JobEvent]:
    return [e for e in parts["ledger"].events(job_id, count=10_000) if e.type is kind]


def cancel_on_first_progress(ledger: JobLedger, job_id: str,
                             at: EventType = EventType.stage_progress) -> threading.Thread:
    """Watch the job's event stream like a client would, and cancel at the first event of type ``at``
    (the first progress event by default)."""

    def watch() -> None:
        last = "0-0"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for event in ledger.events(job_id, after=last, block_ms=200):
                last = event.id
                if event.type is at:
                    cancel_job(ledger, job_id)
                    return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def assert_nothing_left(parts: dict[str, Any], job_id: str) -> None:
    """The job holds no lease, waits on no queue index, and has nothing (even delayed) to publish."""
    store: RedisJobStore = parts["store"]
    assert not [s for s in store.leased_slots() if job_id in s]
    assert dispatched(parts, job_id, at=now() + 3600) == []
    assert all(job_id not in m.decode() for q in ("ar", "dit", "results")
               for m in parts["redis"].zrange(keys.queue_waiting(q), 0, -1))


def test_cancel_stops_an_ar_stage_at_the_next_token(parts: dict[str, Any]) -> None:
    ledger, runner = parts["ledger"], parts["runner"]
    job = parts["submit"].submit("text-to-text", {"prompt": "count"}, {"ar": {"max_tokens": 400, "temperature": 1.0,
                                                                             "seed": 3}})
    (step,) = dispatched(parts, job.id)
    assert step == RunStage(job.id, "ar", 1, "ar")
    watcher = cancel_on_first_progress(ledger, job.id)
    outcome = runner.run(step, worker="test", owner="test#1")
    watcher.join(5)
    final = ledger.require(job.id)
    assert outcome.status == "canceled"
    assert final.status is JobStatus.canceled and final.stage_record("ar").status is StageStatus.canceled
    assert final.stage_record("ar").outputs == {} and final.outputs == []
    progress = events_of(parts, job.id, EventType.stage_progress)
    assert progress and progress[-1].data["step"] < 400  # stopped early, not after generating everything
    assert_nothing_left(parts, job.id)  # no results step, no retry
    # The engine is still usable: the next job on it runs to the end.
    ok = parts["submit"].submit("text-to-text", {"prompt": "again"}, {"ar": {"max_tokens": 4}})
    (ok_step,) = dispatched(parts, ok.id)
    assert runner.run(ok_step, worker="test", owner="test#1").status == "succeeded"


def test_cancel_stops_a_dit_stage_at_the_next_step(parts: dict[str, Any]) -> None:
    ledger, runner = parts["ledger"], parts["runner"]
    job = parts["submit"].submit("slow-image", {"prompt": "slow"}, {"dit": {"num_inference_steps": 200}})
    (step,) = dispatched(parts, job.id)
    watcher = cancel_on_first_progress(ledger, job.id)
    assert runner.run(step, worker="test", owner="test#1").status == "canceled"
    watcher.join(5)
    steps = [e.data["step"] for e in events_of(parts, job.id, EventType.stage_progress)]
    assert steps and max(steps) < 200
    assert ledger.require(job.id).status is JobStatus.canceled
    assert_nothing_left(parts, job.id)


def watching_runner(parts: dict[str, Any]) -> StageRunner:
    """A runner that asks Redis which jobs are followed, as workers do: progress at every step while a
    reader looks (or before the first ask answered), else every hour from the first step (so none)."""
    base: StageRunner = parts["runner"]
    return StageRunner(ledger=base.ledger, catalogue=base.catalogue, artifacts=base.artifacts, engines=base.engines,
                       reporting=Reporting(progress_interval_s=0, progress_unfollowed_interval_s=3600,
                                           followed=partial(job_readers, parts["redis"])),
                       retries=Retries(backoff_s=BACKOFF_S))


def test_a_poll_marks_a_job_looked_at_and_leaves_a_streams_mark_as_it_is(parts: dict[str, Any]) -> None:
    client = parts["redis"]
    client.set(keys.job_followed("job_streamed"), b"stream", ex=35)  # as JobWatcher.follow marks it
    for job_id in ("job_streamed", "job_polled"):
        mark_looked_at(client, job_id)
    assert job_readers(client, ["job_streamed", "job_polled", "job_alone"]) == Readers({"job_streamed"}, {"job_polled"})
    assert client.ttl(keys.job_followed("job_streamed")) > 10 and 0 < client.ttl(keys.job_followed("job_polled")) <= 10


def _poll_until(client: Any, job_id: str, done: threading.Event) -> None:
    """A client polling the job every 2 s, as GET /v1/jobs/{id} marks a job not yet ended looked at (for 10 s):
    the stage is looked at however slowly its steps run."""
    while not done.wait(2):
        mark_looked_at(client, job_id)


def test_progress_is_written_often_only_while_somebody_looks_at_the_job(parts: dict[str, Any]) -> None:
    runner = watching_runner(parts)
    steps_of = {}
    for looked_at in (False, True):
        job = parts["submit"].submit("slow-image", {"prompt": f"looked at: {looked_at}"},
                                     {"dit": {"num_inference_steps": 40}})
        done = threading.Event()
        poller = threading.Thread(target=_poll_until, args=(parts["redis"], job.id, done)) if looked_at else None
        if poller is not None:
            mark_looked_at(parts["redis"], job.id)
            poller.start()
        (step,) = dispatched(parts, job.id)
        try:
            assert runner.run(step, worker="test", owner="test#1").status == "succeeded"
        finally:
            done.set()
            if poller is not None:
                poller.join(5)
        steps_of[looked_at] = [e.data["step"] for e in events_of(parts, job.id, EventType.stage_progress)]
    # nobody looked: no progress once the worker's first ask answered (within GATHER_S of the start,
    # a few steps in at most; until then a job counts as watched), not even the last step
    unread = steps_of[False]
    assert unread == list(range(1, len(unread) + 1)) and len(unread) <= 10, unread
    # looked at: every step from the worker's ask on, the last included (FollowedJobs asks within
    # GATHER_S of a start, a few steps in at most)
    looked = steps_of[True]
    assert looked == list(range(looked[0], 41)) and looked[0] <= 10, looked


def test_a_cancel_stops_a_stage_that_nobody_follows_at_once(parts: dict[str, Any]) -> None:
    """Unfollowed, a stage writes no progress once its worker has asked, and a progress write is where a
    cancel is noticed; the cancel marks the job followed, so the stage's next step writes, is refused,
    and stops it."""
    ledger, runner = parts["ledger"], watching_runner(parts)
    job = parts["submit"].submit("slow-image", {"prompt": "slow"}, {"dit": {"num_inference_steps": 200}})
    (step,) = dispatched(parts, job.id)
    watcher = cancel_on_first_progress(ledger, job.id, at=EventType.stage_started)
    started = time.monotonic()
    assert runner.run(step, worker="test", owner="test#1").status == "canceled"
    watcher.join(5)
    assert time.monotonic() - started < 10  # 200 steps of 256 px take far longer
    steps = [e.data["step"] for e in events_of(parts, job.id, EventType.stage_progress)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) <= 10, steps  # before the first ask at most
    assert ledger.require(job.id).status is JobStatus.canceled


def test_soft_time_limit_fails_the_job_with_a_clear_reason(parts: dict[str, Any]) -> None:
    ledger, runner = parts["ledger"], parts["runner"]
    job = parts["submit"].submit("too-slow-image", {"prompt": "too slow"})
    (step,) = dispatched(parts, job.id)
    started = time.monotonic()
    assert runner.run(step, worker="test", owner="test#1").status == "failed"
    assert time.monotonic() - started < 20
    final = ledger.require(job.id)
    assert final.status is JobStatus.failed
    assert final.error is not None and final.error.stage == "dit" and final.error.type == "StageTimeout"
    assert "soft time limit of 0.6s" in final.error.message
    record = final.stage_record("dit")
    assert record.status is StageStatus.failed and record.attempts == 1  # not a transient error: no retry
    assert events_of(parts, job.id, EventType.stage_retrying) == []
    assert_nothing_left(parts, job.id)


def test_deadline_cancels_a_running_job(parts: dict[str, Any]) -> None:
    ledger, runner = parts["ledger"], parts["runner"]
    job = parts["submit"].submit("slow-image", {"prompt": "deadline"}, cancel_after_s=0.5)
    (step,) = dispatched(parts, job.id)
    assert runner.run(step, worker="test", owner="test#1").status == "canceled"
    final = ledger.require(job.id)
    assert final.status is JobStatus.canceled and final.deadline_at == pytest.approx(final.created_at + 0.5)
    assert final.stage_record("dit").attempts == 1  # it had started: the deadline stopped it while running
    assert ledger.events(job.id)[-1].data["reason"] == "deadline exceeded (cancel_after)"
    assert_nothing_left(parts, job.id)


def test_a_step_taken_after_the_deadline_does_not_start_and_cancels_the_job(parts: dict[str, Any]) -> None:
    ledger, runner = parts["ledger"], parts["runner"]
    job = parts["submit"].submit("slow-image", {"prompt": "too late"}, cancel_after_s=0.05)
    (step,) = dispatched(parts, job.id)
    time.sleep(0.1)  # no worker took it in time
    outcome = runner.run(step, worker="test", owner="test#1")
    assert outcome.status == "skipped" and "deadline" in outcome.detail
    final = ledger.require(job.id)
    assert final.status is JobStatus.canceled and final.stage_record("dit").attempts == 0
    assert events_of(parts, job.id, EventType.stage_started) == []
    assert ledger.events(job.id)[-1].data["reason"] == "deadline exceeded (cancel_after)"
    assert_nothing_left(parts, job.id)


def test_redelivered_steps_are_not_run_again_and_dispatch_nothing(parts: dict[str, Any]) -> None:
    """Each step's result dispatches the next step once, in the same write; a redelivered message is
    refused by attempt, whatever the broker does, and re-sends nothing."""
    ledger, runner, results = parts["ledger"], parts["runner"], parts["results"]
    job = parts["submit"].submit("text-to-image", {"prompt": "once"}, {"ar": {"max_tokens": 4},
                                                                     "dit": {"height": 32, "width": 32,
                                                                             "num_inference_steps": 2}})
    ar = RunStage(job.id, "ar", 1, "ar")
    assert dispatched(parts, job.id) == [ar]
    assert runner.run(ar, worker="w1", owner="w1#1").status == "succeeded"
    dit = RunStage(job.id, "dit", 1, "dit")
    assert dispatched(parts, job.id) == [dit]
    record = ledger.require(job.id).stage_record("ar")
    assert record.outputs["text"].key.startswith(f"jobs/{job.id}/stages/ar/attempt-1/")
    again = runner.run(ar, worker="w2", owner="w2#1")  # the broker redelivered the message
    assert again.status == "skipped" and "not waiting for attempt 1" in again.detail
    assert dispatched(parts, job.id) == []
    assert ledger.require(job.id).stage_record("ar") == record  # attempts 1, worker w1, the same outputs
    assert record.attempts == 1 and record.worker == "w1"

    assert runner.run(dit, worker="w1", owner="w1#1").status == "succeeded"
    assert dispatched(parts, job.id) == [AssembleResults(job.id, 1)]
    assert runner.run(dit, worker="w2", owner="w2#1").status == "skipped"
    assert dispatched(parts, job.id) == []

    assert results.run(AssembleResults(job.id, 1), worker="r", owner="r#1").status == "succeeded"
    done = ledger.require(job.id)
    assert done.status is JobStatus.succeeded and [o.name for o in done.outputs] == ["image", "text"]
    assert results.run(AssembleResults(job.id, 1), worker="r2", owner="r2#1").status == "skipped"
    assert ledger.require(job.id).completed_at == done.completed_at  # results run once in effect
    # A finished job is never re-run, whichever attempt a message names.
    for late in (ar, RunStage(job.id, "ar", 2, "ar"), RunStage(job.id, "dit", 2, "dit")):
        assert runner.run(late, worker="w3", owner="w3#1").status == "skipped"
    assert results.run(AssembleResults(job.id, 2), worker="w3", owner="w3#1").status == "skipped"
    assert ledger.require(job.id) == done
    assert [e.type for e in ledger.events(job.id)].count(EventType.stage_started) == 2
    assert_nothing_left(parts, job.id)


def test_a_stage_whose_lease_is_taken_back_stops_and_its_next_attempt_is_queued(parts: dict[str, Any]) -> None:
    """The reaper takes the attempt back (as when its worker is cut off from Redis): the attempt stops
    at its next step without recording anything, and attempt 2 is dispatched at once."""
    ledger, runner = parts["ledger"], parts["runner"]
    job = parts["submit"].submit("slow-image", {"prompt": "cut off"})
    (step,) = dispatched(parts, job.id)
    outcomes: list[str] = []

    def reap_on_first_progress() -> None:
        last = "0-0"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for event in ledger.events(job.id, after=last, block_ms=200):
                last = event.id
                if event.type is EventType.stage_progress:
                    outcomes.append(ledger.expire(step.slot, dead_owner=lambda owner: owner == "w1#1"))
                    return

    reaper = threading.Thread(target=reap_on_first_progress, daemon=True)
    reaper.start()
    outcome = runner.run(step, worker="w1", owner="w1#1")
    reaper.join(5)
    assert outcomes == ["requeued"] and outcome.status == "lost"
    after = ledger.require(job.id)
    record = after.stage_record("dit")
    assert after.status is JobStatus.running and after.error is None
    assert record.status is StageStatus.queued and record.attempts == 1 and record.outputs == {}
    (requeued,) = events_of(parts, job.id, EventType.stage_requeued)
    assert requeued.data["attempt"] == 1 and "w1 restarted without finishing it" in requeued.data["reason"]
    steps = [e.data["step"] for e in events_of(parts, job.id, EventType.stage_progress)]
    assert steps and max(steps) < 200  # stopped at its next step, not at the end
    assert not list(parts["redis"].scan_iter(keys.artifact(f"jobs/{job.id}/*")))  # nothing stored
    assert not (parts["dir"] / "jobs" / job.id).exists()
    assert dispatched(parts, job.id) == [RunStage(job.id, "dit", 2, "dit")]  # due now: no backoff
    assert runner.run(step, worker="w1", owner="w1#1").status == "skipped"  # attempt 1 never comes back
    cancel_job(ledger, job.id)


class FlakyIntermediates:
    """The artifact store's intermediates are unreachable for the next ``failures`` puts (an S3 or
    Redis blip): a transient error, raised after the engine ran."""

    def __init__(self, artifacts: ArtifactStore, failures: int) -> None:
        self.put = artifacts.put_intermediates
        self.failures = failures
        self.calls = 0

    def __call__(self, items: Sequence[tuple[str, bytes, str]]) -> list[ArtifactRef]:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise ArtifactStoreUnavailable("redis", "put", items[0][0], "Connection refused")
        return self.put(items)


def test_a_transient_error_queues_the_next_attempt_after_a_backoff(parts: dict[str, Any],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ledger, runner = parts["ledger"], parts["runner"]
    monkeypatch.setattr(parts["artifacts"], "put_intermediates", FlakyIntermediates(parts["artifacts"], 1))
    job = parts["submit"].submit("text-to-text", {"prompt": "blip"}, {"ar": {"max_tokens": 4}})
    (first,) = dispatched(parts, job.id)
    outcome = runner.run(first, worker="w1", owner="w1#1")
    assert outcome.status == "retrying" and "Connection refused" in outcome.detail

    after = ledger.require(job.id)
    record = after.stage_record("ar")
    assert after.status is JobStatus.running and after.error is None
    assert record.status is StageStatus.queued and record.attempts == 1 and record.lease_owner is None
    (retrying,) = events_of(parts, job.id, EventType.stage_retrying)
    assert retrying.data["attempt"] == 1 and retrying.data["reason"].startswith("ArtifactStoreUnavailable: ")
    assert BACKOFF_S * 0.5 <= retrying.data["retry_in_s"] <= BACKOFF_S * 1.5  # attempt 1's backoff, with jitter
    # Attempt 2 waits in the outbox (and on its queue's index) until the backoff is over, not in a worker.
    second = RunStage(job.id, "ar", 2, "ar")
    due = parts["redis"].zscore(keys.OUTBOX, step_id(second))
    assert due is not None and due == pytest.approx(retrying.at + retrying.data["retry_in_s"], abs=0.01)
    assert record.queued_at == pytest.approx(due)
    assert parts["redis"].zscore(keys.queue_waiting("ar"), second.slot) == pytest.approx(due)
    assert parts["store"].queue_counts("ar") == (1, 0) and parts["store"].leased_slots() == []
    assert dispatched(parts, job.id) == []  # not due yet
    assert runner.run(first, worker="w2", owner="w2#1").status == "skipped"  # attempt 1 is over
    assert dispatched(parts, job.id, at=due) == [second]

    assert runner.run(second, worker="w2", owner="w2#1").status == "succeeded"
    done = ledger.require(job.id).stage_record("ar")
    assert done.status is StageStatus.succeeded and done.attempts == 2 and done.worker == "w2"
    assert all(r.key.startswith(f"jobs/{job.id}/stages/ar/attempt-2/") for r in done.outputs.values())
    assert dispatched(parts, job.id) == [AssembleResults(job.id, 1)]


def test_a_stage_that_keeps_hitting_transient_errors_fails_with_the_original_error(
        parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    ledger, runner = parts["ledger"], parts["runner"]
    flaky = FlakyIntermediates(parts["artifacts"], 1000)
    monkeypatch.setattr(parts["artifacts"], "put_intermediates", flaky)
    job = parts["submit"].submit("text-to-text", {"prompt": "outage"}, {"ar": {"max_tokens": 4}})
    statuses: list[str] = []
    step = dispatched(parts, job.id)
    while step:
        (only,) = step
        assert only == RunStage(job.id, "ar", len(statuses) + 1, "ar")
        statuses.append(runner.run(only, worker="w", owner="w#1").status)
        step = dispatched(parts, job.id, at=now() + 3600)  # whatever the backoff, the next attempt is due then
    assert statuses == ["retrying"] * (MAX_ATTEMPTS - 1) + ["failed"]
    assert flaky.calls == MAX_ATTEMPTS  # one engine run and one failed put per attempt
    retries = events_of(parts, job.id, EventType.stage_retrying)
    assert [e.data["attempt"] for e in retries] == [1, 2]
    delays = [e.data["retry_in_s"] for e in retries]
    assert BACKOFF_S * 0.5 <= delays[0] <= BACKOFF_S * 1.5 and 2 * BACKOFF_S * 0.5 <= delays[1] <= 2 * BACKOFF_S * 1.5
    final = ledger.require(job.id)
    assert final.status is JobStatus.failed and final.error is not None
    assert (final.error.stage, final.error.type) == ("ar", "ArtifactStoreUnavailable")
    assert "Connection refused" in final.error.message
    record = final.stage_record("ar")
    assert record.status is StageStatus.failed and record.attempts == MAX_ATTEMPTS
    assert ledger.events(job.id)[-1].type is EventType.job_failed
    assert_nothing_left(parts, job.id)


def test_idempotency_key_returns_the_same_job_or_conflicts(parts: dict[str, Any]) -> None:
    submit = parts["submit"]
    a, created_a = submit.submit_idempotent("text-to-text", {"prompt": "hi"}, None, idempotency_key="k-1")
    b, created_b = submit.submit_idempotent("text-to-text", {"prompt": "hi"}, None, idempotency_key="k-1")
    assert created_a and not created_b and a.id == b.id
    assert dispatched(parts, a.id) == [RunStage(a.id, "ar", 1, "ar")]  # the replay dispatched nothing more
    assert [j.id for j in parts["ledger"].page(limit=10).jobs] == [a.id]
    with pytest.raises(IdempotencyConflict, match=a.id):
        submit.submit_idempotent("text-to-text", {"prompt": "other"}, None, idempotency_key="k-1")
    assert [j.id for j in parts["ledger"].page(limit=10).jobs] == [a.id]
