"""Job state v2, through the ledger, on both stores: every transition is atomic with what it causes,
attempts are fenced, and nothing is dispatched twice or lost."""

from __future__ import annotations

import threading
import time

import pytest

from omni_jobs.artifacts.refs import ArtifactRef
from omni_jobs.core import keys
from omni_jobs.core.errors import IdempotencyConflict, JobAlreadyFinished, JobNotFound
from omni_jobs.core.json_types import JsonObject
from omni_jobs.dispatch.scheduling import Scheduler
from omni_jobs.jobs.change import Change
from omni_jobs.jobs.ledger import Acquired, JobLedger, Lease, Refused, WrittenOutputs
from omni_jobs.jobs.models import (
    EventType,
    Job,
    JobError,
    JobEvent,
    JobOutput,
    JobStatus,
    JobWebhook,
    StageRecord,
    StageStatus,
    WebhookDelivery,
    new_job_id,
    now,
)
from omni_jobs.jobs.steps import AssembleResults, DeliverWebhook, RunStage, Step, step_id
from omni_jobs.jobs.store import JobStore


def two_stage_job(*, tenant: str = "t1", webhook: JobWebhook | None = None) -> Job:
    return Job(id=new_job_id(), pipeline="text-to-image", input={"prompt": "a fox"}, tenant=tenant, webhook=webhook,
               stages=[StageRecord(id="ar", engine="ar", queue="ar"),
                       StageRecord(id="dit", engine="dit", queue="dit", needs=["ar"])])


def fan_in_job() -> Job:
    return Job(id=new_job_id(), pipeline="fan-in", input={},
               stages=[StageRecord(id="a", engine="ar", queue="ar"), StageRecord(id="b", engine="ar", queue="ar"),
                       StageRecord(id="c", engine="dit", queue="dit", needs=["a", "b"])])


def ref(name: str) -> ArtifactRef:
    return ArtifactRef(backend="redis", key=f"jobs/x/{name}", media_type="application/json", size=1, sha256="0" * 64)


def claim(store: JobStore, job_id: str | None = None) -> list[Step]:
    """What a relay would publish now: the scheduler's releases first (no worker limit here)."""
    Scheduler(store, None).release_all()
    entries = store.claim_outbox(now=now(), limit=100, hold_s=60.0, job_id=job_id)
    store.ack_outbox([e.id for e in entries])
    return [e.step for e in entries]


def start(ledger: JobLedger, step: Step, owner: str = "w1#1") -> Acquired:
    taken = ledger.acquire(step, worker=owner.split("#")[0], owner=owner)
    assert isinstance(taken, Acquired), taken
    return taken


# --- submit ---
def test_submit_stores_the_job_its_events_and_its_first_dispatch_together(ledger: JobLedger, store: JobStore) -> None:
    job, created = ledger.submit(two_stage_job(), ["ar"])
    assert created
    stored = ledger.require(job.id)
    assert stored.status is JobStatus.queued and stored.stage_record("ar").status is StageStatus.queued
    assert stored.stage_record("dit").status is StageStatus.pending and stored.stage_record("dit").needs == ["ar"]
    assert [e.type for e in ledger.events(job.id)] == ["job.queued", "stage.queued"]
    assert claim(store) == [RunStage(job.id, "ar", 1, "ar")]
    assert store.queue_counts("ar") == (1, 0) and store.queue_position(stored) == 1
    assert [j.id for j in ledger.page(limit=10, tenant="t1").jobs] == [job.id]
    assert ledger.page(limit=10, tenant="t2").jobs == []


def test_an_idempotency_key_returns_the_first_job_and_refuses_another_body(ledger: JobLedger, store: JobStore) -> None:
    first, created = ledger.submit(two_stage_job(), ["ar"], idempotency=("key-1", "fp-a"))
    again, created_again = ledger.submit(two_stage_job(), ["ar"], idempotency=("key-1", "fp-a"))
    assert created and not created_again and again.id == first.id
    with pytest.raises(IdempotencyConflict, match=first.id):
        ledger.submit(two_stage_job(), ["ar"], idempotency=("key-1", "fp-b"))
    # The refused submissions wrote nothing: one job, one dispatch.
    assert len(ledger.page(limit=10).jobs) == 1 and len(claim(store)) == 1
    # Keys are per tenant.
    other, created_other = ledger.submit(two_stage_job(tenant="t2"), ["ar"], idempotency=("key-1", "fp-b"))
    assert created_other and other.id != first.id


# --- taking a step: attempts are fenced ---
def test_only_the_awaited_attempt_starts_and_a_duplicate_is_refused(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    (step,) = claim(store)
    taken = start(ledger, step, "w1#1")
    assert taken.job.status is JobStatus.running and taken.job.stage_record("ar").attempts == 1
    assert start(ledger, step, "w1#1").lease == taken.lease  # the same worker asking again: re-entrant
    duplicate = ledger.acquire(step, worker="w2", owner="w2#1")  # a redelivered message elsewhere
    assert isinstance(duplicate, Refused) and "attempt 1 is running on w1" in duplicate.reason
    stale = ledger.acquire(RunStage(job.id, "ar", 3, "ar"), worker="w2", owner="w2#1")
    assert isinstance(stale, Refused) and "not waiting for attempt 3" in stale.reason
    assert store.queue_counts("ar") == (0, 1) and store.leased_slots() == [f"stage:{job.id}:ar"]


def test_completion_queues_the_next_stage_then_the_results_step(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    ar = start(ledger, claim(store)[0])
    done = ledger.complete_stage(ar.lease, {"text": ref("text")}, {"engine_s": 0.1})
    assert isinstance(done, Job) and done.stage_record("dit").status is StageStatus.queued
    assert claim(store) == [RunStage(job.id, "dit", 1, "dit")]
    assert store.leased_slots() == [] and store.queue_counts("ar") == (0, 0)
    dit = start(ledger, RunStage(job.id, "dit", 1, "dit"))
    ledger.complete_stage(dit.lease, {"image": ref("image")}, {})
    assert claim(store) == [AssembleResults(job.id, 1)]
    results = start(ledger, AssembleResults(job.id, 1))
    output = JobOutput(name="image", type="image", media_type="image/png", size=1, artifact=ref("image"))
    final = ledger.complete_results(results.lease, [output])
    assert isinstance(final, Job) and final.status is JobStatus.succeeded and final.outputs == [output]
    assert claim(store) == [] and store.leased_slots() == []
    assert [e.type for e in ledger.events(job.id)][-3:] == ["stage.started", "stage.succeeded", "job.succeeded"]
    # A second results attempt, or a late result, changes nothing.
    assert isinstance(ledger.acquire(AssembleResults(job.id, 2), worker="w", owner="w#2"), Refused)
    assert ledger.complete_results(results.lease, []) == final


def test_events_an_attempt_hands_its_result_go_out_with_it_or_not_at_all(ledger: JobLedger, store: JobStore) -> None:
    """A streamed text's last delta is written by the stage's completion, just before stage.succeeded;
    a refused completion (the attempt lost its lease) writes none of it."""
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    ar = start(ledger, claim(store)[0])

    def last_delta(text: str) -> list[JobEvent]:
        return [JobEvent(job_id=job.id, type=EventType.output_delta, at=now(),
                         data={"stage": "ar", "output": "text", "text": text, "index": 0, "attempt": 1})]

    stale = Lease(RunStage(job.id, "ar", 1, "ar"), "w9#1")  # not the owner of attempt 1
    assert isinstance(ledger.complete_stage(stale, {"text": ref("text")}, {}, first=last_delta("lost words")), Refused)
    assert [e for e in ledger.events(job.id) if e.type == EventType.output_delta] == []
    done = ledger.complete_stage(ar.lease, {"text": ref("text")}, {}, first=last_delta("Hello world"))
    assert isinstance(done, Job) and done.stage_record("ar").status is StageStatus.succeeded
    assert [(e.type, e.data.get("text")) for e in ledger.events(job.id)][-3:] == [
        (EventType.output_delta, "Hello world"), (EventType.stage_succeeded, None), (EventType.stage_queued, None)]
    # the same result written again (a retried write) adds nothing
    assert ledger.complete_stage(ar.lease, {"text": ref("text")}, {}, first=last_delta("Hello world")) == done
    assert len([e for e in ledger.events(job.id) if e.type == EventType.output_delta]) == 1


def test_the_last_stage_can_take_the_results_step_in_the_same_write(ledger: JobLedger, store: JobStore) -> None:
    """Results inline: the worker that completes the last stage holds the results lease at once; nothing
    goes through the results queue, and the outputs it writes end the job."""
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    ar = start(ledger, claim(store)[0])
    after_ar = ledger.complete_stage(ar.lease, {"text": ref("text")}, {}, results_worker="ar@h")
    assert isinstance(after_ar, Job) and after_ar.results.status is StageStatus.pending  # not the last stage
    dit = start(ledger, claim(store)[0], "dit@h#1")
    done = ledger.complete_stage(dit.lease, {"image": ref("image")}, {}, results_worker="dit@h")
    assert isinstance(done, Job) and done.status is JobStatus.running
    assert done.results.status is StageStatus.running and done.results.attempts == 1
    assert done.results.worker == "dit@h" and done.results.lease_owner == "dit@h#1"
    assert claim(store) == []  # no AssembleResults message: this worker has it
    assert store.leased_slots() == [f"results:{job.id}"] and store.queue_counts("results") == (0, 1)
    # Another delivery of the step finds it taken; the holder's write ends the job.
    assert isinstance(ledger.acquire(AssembleResults(job.id, 1), worker="r", owner="r#1"), Refused)
    output = JobOutput(name="image", type="image", media_type="image/png", size=1, artifact=ref("image"))
    final = ledger.complete_results(Lease(AssembleResults(job.id, 1), "dit@h#1"), [output])
    assert isinstance(final, Job) and final.status is JobStatus.succeeded and final.outputs == [output]
    assert store.leased_slots() == [] and store.queue_counts("results") == (0, 0)


def test_the_last_stage_ends_the_job_in_its_own_write_once_its_files_are_written(
        ledger: JobLedger, store: JobStore) -> None:
    """Results inline, the final files written before the last stage's completion: that one write
    records the stage, takes the results step and ends the job. Files made of other outputs than the
    job has (a stage ran again meanwhile) end nothing: the results step is taken, as without them."""
    output = JobOutput(name="image", type="image", media_type="image/png", size=1, artifact=ref("image"))
    for made_of_text in ("text", "older text"):
        job, _ = ledger.submit(two_stage_job(), ["ar"])
        ledger.complete_stage(start(ledger, claim(store)[0]).lease, {"text": ref("text")}, {}, results_worker="ar@h")
        dit = start(ledger, claim(store)[0], "dit@h#1")
        written = WrittenOutputs([{"text": ref(made_of_text)}, {"image": ref("image")}], [output])
        done = ledger.complete_stage(dit.lease, {"image": ref("image")}, {}, results_worker="dit@h", written=written)
        assert isinstance(done, Job) and claim(store) == []
        if made_of_text == "older text":
            assert done.status is JobStatus.running and done.results.lease_owner == "dit@h#1"
            assert store.leased_slots() == [f"results:{job.id}"]
            continue
        assert done.status is JobStatus.succeeded and done.outputs == [output]
        assert done.results.status is StageStatus.succeeded and done.results.attempts == 1
        assert done.results.lease_owner is None and store.leased_slots() == []
        assert store.queue_counts("results") == (0, 0) and store.queue_counts("dit") == (0, 0)
        assert [e.type for e in ledger.events(job.id)][-2:] == [EventType.stage_succeeded, EventType.job_succeeded]
        assert ledger.require(job.id) == done
        # the same write again (a retried call): the ended job, unchanged
        assert ledger.complete_stage(dit.lease, {"image": ref("image")}, {}, results_worker="dit@h",
                                     written=written) == done


def test_results_decided_on_the_taken_job_end_it_or_see_a_later_write(ledger: JobLedger, store: JobStore) -> None:
    """complete_results with the job as the results step took it (no read): it ends the job, or, where
    the job changed meanwhile (canceled), the guards refuse that write and the stored job decides."""
    outputs = [JobOutput(name="image", type="image", media_type="image/png", size=1, artifact=ref("image"))]
    ended: list[Job] = []
    for cancel in (False, True):
        job, _ = ledger.submit(two_stage_job(), ["ar"])
        ledger.complete_stage(start(ledger, claim(store)[0]).lease, {"text": ref("text")}, {})
        dit = start(ledger, claim(store)[0], "dit@h#1")
        taken = ledger.complete_stage(dit.lease, {"image": ref("image")}, {}, results_worker="dit@h")
        assert isinstance(taken, Job) and taken.results.status is StageStatus.running
        if cancel:
            ledger.cancel(job.id)
        lease = Lease(AssembleResults(job.id, 1), "dit@h#1")
        final = ledger.complete_results(lease, outputs, snapshot=taken)
        if cancel:
            assert isinstance(final, Refused) and ledger.require(job.id).status is JobStatus.canceled
            assert ledger.require(job.id).outputs == []
        else:
            assert isinstance(final, Job) and final.status is JobStatus.succeeded and final.outputs == outputs
            assert ledger.require(job.id) == final and store.leased_slots() == []
            # the same write again, from the same stale snapshot (a retried call): the ended job, unchanged
            assert ledger.complete_results(lease, outputs, snapshot=taken) == final
            ended.append(final)
    assert [e.type for e in ledger.events(ended[0].id)][-1] == "job.succeeded"


def test_inline_results_of_a_dead_worker_go_to_the_results_queue(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    ledger.complete_stage(start(ledger, claim(store)[0]).lease, {"text": ref("text")}, {})
    dit = start(ledger, claim(store)[0], "dit@host#111.aaaa")
    ledger.complete_stage(dit.lease, {"image": ref("image")}, {}, results_worker="dit@host")
    # The worker died before writing the outputs: its restarted node takes the step back at once.
    assert ledger.expire(f"results:{job.id}", dead_owner=lambda owner: owner == "dit@host#111.aaaa") == "requeued"
    assert claim(store) == [AssembleResults(job.id, 2)]
    results = start(ledger, AssembleResults(job.id, 2), "results@h#1")
    final = ledger.complete_results(results.lease, [])
    assert isinstance(final, Job) and final.status is JobStatus.succeeded


def test_two_parents_finishing_together_queue_their_child_exactly_once(ledger: JobLedger, store: JobStore) -> None:
    for _ in range(10):
        job, _ = ledger.submit(fan_in_job(), ["a", "b"])
        steps = {s.stage_id: s for s in claim(store, job.id) if isinstance(s, RunStage)}
        leases = [start(ledger, steps["a"], "w1#1").lease, start(ledger, steps["b"], "w2#1").lease]
        barrier = threading.Barrier(2)

        def finish(lease: Lease, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            ledger.complete_stage(lease, {}, {})

        threads = [threading.Thread(target=finish, args=(lease,)) for lease in leases]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert claim(store, job.id) == [RunStage(job.id, "c", 1, "dit")]
        assert ledger.require(job.id).stage_record("c").status is StageStatus.queued


def test_a_stale_attempts_late_result_is_discarded(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    first = start(ledger, claim(store)[0], "w1#1")
    _expire_now(store, ledger, first.lease)
    assert ledger.expire(first.lease.slot) == "requeued"
    second_step = claim(store)[0]
    assert second_step == RunStage(job.id, "ar", 2, "ar")
    second = start(ledger, second_step, "w2#1")
    late = ledger.complete_stage(first.lease, {"text": ref("stale")}, {})
    assert isinstance(late, Refused) and "stale attempt 1" in late.reason
    assert ledger.progress(first.lease, first.job, 1, 4, "tokens") == "lost"
    assert not ledger.fail(job.id, JobError(stage="ar", type="X", message="late failure"), lease=first.lease)
    done = ledger.complete_stage(second.lease, {"text": ref("fresh")}, {})
    assert isinstance(done, Job) and done.stage_record("ar").outputs["text"].key.endswith("fresh")
    assert done.status is JobStatus.running and done.stage_record("ar").attempts == 2


def _expire_now(store: JobStore, ledger: JobLedger, lease: Lease) -> None:
    """Make a lease look expired (as if its worker stopped renewing it a while ago)."""
    job_key = keys.job(lease.job_id)
    prefix = f"stage:{lease.step.stage_id}:" if isinstance(lease.step, RunStage) else "results:"
    past = repr(now() - 1)
    assert store.commit(Change().hset(job_key, {prefix + "lease_until": past}).zadd(keys.LEASES, lease.slot,
                                                                                      now() - 1)) is None


# --- leases and the reaper's transitions ---
def test_an_expired_lease_queues_the_next_attempt_and_a_live_one_is_left_alone(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    taken = start(ledger, claim(store)[0])
    assert store.expired_leases(now=now(), limit=10) == []
    assert ledger.expire(taken.lease.slot) == "alive"
    assert ledger.renew([taken.lease]) == []
    _expire_now(store, ledger, taken.lease)
    assert store.expired_leases(now=now(), limit=10) == [taken.lease.slot]
    assert ledger.expire(taken.lease.slot) == "requeued"
    after = ledger.require(job.id)
    record = after.stage_record("ar")
    assert record.status is StageStatus.queued and record.attempts == 1 and record.lease_owner is None
    requeued = [e for e in ledger.events(job.id) if e.type == EventType.stage_requeued]
    assert requeued and "lease expired" in requeued[0].data["reason"] and requeued[0].data["attempt"] == 1
    assert claim(store) == [RunStage(job.id, "ar", 2, "ar")]
    assert store.expired_leases(now=now(), limit=10) == [] and store.queue_counts("ar") == (1, 0)
    assert ledger.renew([taken.lease]) == [taken.lease]  # the old holder finds out at its next renewal


def test_a_stage_that_keeps_losing_its_worker_fails_its_job(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    for attempt in range(1, 4):  # max_attempts = 3
        taken = start(ledger, RunStage(job.id, "ar", attempt, "ar"), f"w{attempt}#1")
        _expire_now(store, ledger, taken.lease)
        outcome = ledger.expire(taken.lease.slot)
    assert outcome == "failed"
    failed = ledger.require(job.id)
    assert failed.status is JobStatus.failed and failed.error is not None
    assert failed.error.type == "WorkerLost" and "gave up after 3 attempts" in failed.error.message
    assert store.leased_slots() == []


def test_a_dead_nodes_leases_are_taken_back_at_once(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    taken = start(ledger, claim(store)[0], "dit@host#111.aaaa")
    alive = ledger.expire(taken.lease.slot, dead_owner=lambda owner: owner == "dit@host#222.bbbb")
    assert alive == "alive"
    assert ledger.expire(taken.lease.slot, dead_owner=lambda owner: owner == "dit@host#111.aaaa") == "requeued"
    assert claim(store) == [RunStage(job.id, "ar", 2, "ar")]


def test_a_transient_error_backs_off_then_gives_up_with_the_original_error(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    error = JobError(stage="ar", type="ArtifactStoreUnavailable", message="s3 unreachable")
    taken = start(ledger, claim(store)[0])
    assert ledger.retry_later(taken.lease, error, delay_s=30.0) == "retrying"
    assert claim(store) == []  # not due yet
    entries = store.claim_outbox(now=now() + 31, limit=10, hold_s=1.0)
    assert [e.step for e in entries] == [RunStage(job.id, "ar", 2, "ar")]
    (retrying,) = [e for e in ledger.events(job.id) if e.type == EventType.stage_retrying]
    assert retrying.data["retry_in_s"] == pytest.approx(30.0, abs=0.5) and "s3 unreachable" in retrying.data["reason"]
    for attempt in (2, 3):
        taken = start(ledger, RunStage(job.id, "ar", attempt, "ar"))
        outcome = ledger.retry_later(taken.lease, error, delay_s=0.0)
    assert outcome == "failed"
    failed = ledger.require(job.id)
    assert failed.error == error and failed.stage_record("ar").status is StageStatus.failed


# --- progress, cancel ---
def test_progress_is_recorded_until_the_job_is_canceled(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    taken = start(ledger, claim(store)[0])
    assert ledger.progress(taken.lease, taken.job, 3, 8, "tokens") == "ok"
    shown = ledger.require(job.id)
    assert shown.progress is not None and (shown.progress.step, shown.progress.total) == (3, 8)
    canceled = ledger.cancel(job.id)
    assert canceled.status is JobStatus.canceled and canceled.stage_record("dit").status is StageStatus.canceled
    assert ledger.progress(taken.lease, taken.job, 4, 8, "tokens") == "canceled"
    assert ledger.renew([taken.lease]) == [taken.lease]
    assert store.leased_slots() == [] and store.queue_counts("ar") == (0, 0)
    with pytest.raises(JobAlreadyFinished):
        ledger.cancel(job.id)
    with pytest.raises(JobNotFound):
        ledger.cancel("job_missing")


def test_partial_outputs_are_published_in_order_while_the_lease_holds(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    taken = start(ledger, claim(store)[0])
    for index, text in enumerate(["Hel", "lo", " world"]):
        data = {"stage": "ar", "output": "text", "text": text, "index": index}
        assert ledger.publish(taken.lease, taken.job, EventType.output_delta, data) == "ok"
    assert ledger.progress(taken.lease, taken.job, 3, 8, "tokens") == "ok"
    deltas = [e for e in ledger.events(job.id) if e.type == EventType.output_delta]
    assert "".join(e.data["text"] for e in deltas) == "Hello world"
    assert [e.data["index"] for e in deltas] == [0, 1, 2]
    shown = ledger.require(job.id)
    assert shown.progress is not None and shown.progress.step == 3  # a delta changes no job field
    ledger.cancel(job.id)
    assert ledger.publish(taken.lease, taken.job, EventType.output_delta,
                          {"stage": "ar", "output": "text", "text": "!", "index": 3}) == "canceled"
    assert [e.data["text"] for e in ledger.events(job.id) if e.type == EventType.output_delta] == ["Hel", "lo", " world"]


def test_reports_while_running_change_no_job_field_whatever_the_snapshot_holds(ledger: JobLedger,
                                                                              store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    taken = start(ledger, claim(store)[0])
    stored = ledger.require(job.id)
    stale = taken.job.model_copy(deep=True)  # a worker's copy may lag behind fields it does not guard
    stale.params = {"ar": {"max_tokens": 1}}
    stale.stage_record("dit").attempts = 7
    assert ledger.progress(taken.lease, stale, 2, 8, "tokens") == "ok"
    assert ledger.publish(taken.lease, stale, EventType.output_delta,
                          {"stage": "ar", "output": "text", "text": "Hi", "index": 0}) == "ok"
    shown = ledger.require(job.id)
    assert shown.progress is not None and (shown.progress.stage, shown.progress.step, shown.progress.total) == ("ar", 2, 8)
    assert shown.model_copy(update={"progress": None}) == stored
    assert [(e.type, e.data.get("step"), e.data.get("text")) for e in ledger.events(job.id)][-2:] == [
        (EventType.stage_progress, 2, None), (EventType.output_delta, None, "Hi")]


def test_partial_outputs_of_several_stages_go_in_one_call_each_under_its_own_lease(ledger: JobLedger,
                                                                                  store: JobStore) -> None:
    kept, _ = ledger.submit(two_stage_job(), ["ar"])
    dropped, _ = ledger.submit(two_stage_job(), ["ar"])
    taken = {t.lease.job_id: t for t in (start(ledger, step, owner=f"w1#{i}") for i, step in enumerate(claim(store)))}
    ledger.cancel(dropped.id)

    def delta(text: str) -> JsonObject:
        return {"stage": "ar", "output": "text", "text": text, "index": 0}

    writes = [(taken[job_id].lease, taken[job_id].job, EventType.output_delta, delta(text))
              for job_id, text in ((dropped.id, "lost words"), (kept.id, "Hello"))]
    assert ledger.publish_many(writes) == ["canceled", "ok"]
    assert [e.data["text"] for e in ledger.events(kept.id) if e.type == EventType.output_delta] == ["Hello"]
    assert [e for e in ledger.events(dropped.id) if e.type == EventType.output_delta] == []
    assert ledger.require(kept.id).stage_record("ar").status is StageStatus.running  # no field changed


def test_canceling_a_waiting_job_withdraws_its_unpublished_dispatch(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    ledger.cancel(job.id)
    assert claim(store) == []
    assert isinstance(ledger.acquire(RunStage(job.id, "ar", 1, "ar"), worker="w", owner="w#1"), Refused)


def test_a_job_past_its_deadline_is_canceled_instead_of_started(ledger: JobLedger, store: JobStore) -> None:
    job = two_stage_job()
    job.deadline_at = now() - 1
    ledger.submit(job, ["ar"])
    refused = ledger.acquire(claim(store)[0], worker="w", owner="w#1")
    assert isinstance(refused, Refused) and "deadline" in refused.reason
    assert ledger.require(job.id).status is JobStatus.canceled


# --- webhooks: messages are created with the change that causes them ---
def test_webhook_messages_keep_their_id_across_attempts_and_record_each(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(webhook=JobWebhook(url="https://example.com/h", events=["completed"])),
                           ["ar"])
    taken = start(ledger, claim(store)[0])
    assert claim(store) == []  # job.running is a `start` event: not subscribed
    ledger.fail(job.id, JobError(stage="ar", type="StageError", message="boom"), lease=taken.lease)
    (message,) = claim(store)
    assert isinstance(message, DeliverWebhook) and message.event == "completed" and message.attempt == 1
    sending = start(ledger, message, "hooks#1")
    first = WebhookDelivery(id=message.message_id, event="completed", attempt=1, at=now(), status_code=503)
    assert ledger.finish_webhook(sending.lease, first, retry_at=now() + 60)
    assert claim(store) == []  # the retry is due in a minute
    assert store.webhook_slots(job.id)[message.message_id].pending  # more attempts may be recorded
    (retry,) = [e.step for e in store.claim_outbox(now=now() + 61, limit=10, hold_s=1.0)]
    assert retry == DeliverWebhook(job.id, message.message_id, "completed", 2)
    again = start(ledger, retry, "hooks#1")
    second = WebhookDelivery(id=message.message_id, event="completed", attempt=2, at=now(), status_code=200)
    assert ledger.finish_webhook(again.lease, second, retry_at=None, final_status="delivered")
    assert not ledger.finish_webhook(again.lease, second, retry_at=None)  # recorded once
    hook = ledger.require(job.id).webhook
    assert hook is not None and [(d.attempt, d.status_code) for d in hook.deliveries] == [(1, 503), (2, 200)]
    assert store.webhook_slots(job.id)[message.message_id].status == "delivered"
    assert not store.webhook_slots(job.id)[message.message_id].pending
    assert isinstance(ledger.acquire(retry, worker="hooks", owner="hooks#2"), Refused)


def test_a_webhook_attempt_lost_with_its_worker_is_sent_again_with_the_same_id(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(webhook=JobWebhook(url="https://example.com/h", events=["start"])), ["ar"])
    start(ledger, claim(store)[0])
    (message,) = claim(store)
    assert isinstance(message, DeliverWebhook) and message.event == "start"
    sending = start(ledger, message, "hooks@h#1.a")
    assert ledger.expire(sending.lease.slot, dead_owner=lambda owner: owner == "hooks@h#1.a") == "requeued"
    assert claim(store) == [DeliverWebhook(job.id, message.message_id, "start", 2)]


# --- the outbox and the watchdog ---
def test_a_claim_holds_an_entry_until_acked_or_the_hold_runs_out(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    Scheduler(store, None).release_all()
    held = store.claim_outbox(now=now(), limit=10, hold_s=5.0)
    assert [e.step for e in held] == [RunStage(job.id, "ar", 1, "ar")]
    assert store.claim_outbox(now=now(), limit=10, hold_s=5.0) == []  # another relay skips it meanwhile
    assert store.outbox_holds([held[0].id]) == {held[0].id}
    again = store.claim_outbox(now=now() + 6, limit=10, hold_s=5.0)  # the first relay died: it is due again
    assert [e.id for e in again] == [held[0].id] == [step_id(RunStage(job.id, "ar", 1, "ar"))]
    store.ack_outbox([held[0].id])
    assert store.claim_outbox(now=now() + 60, limit=10, hold_s=5.0) == [] and store.outbox_holds([held[0].id]) == set()


def test_a_published_step_that_vanished_is_dispatched_again(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(), ["ar"])
    Scheduler(store, None).release_all()
    assert not ledger.redispatch(f"stage:{job.id}:ar")  # released, still in the outbox: nothing was lost
    claim(store)  # published: now only the broker has it, and the broker loses it
    assert store.released("ar", before=now() + 1, limit=10) == [f"stage:{job.id}:ar"]
    assert ledger.redispatch(f"stage:{job.id}:ar")
    assert claim(store) == [RunStage(job.id, "ar", 1, "ar")]  # the same attempt: only one can start it
    start(ledger, RunStage(job.id, "ar", 1, "ar"))
    assert not ledger.redispatch(f"stage:{job.id}:ar")


# --- reading ---
def test_lists_filter_by_status_and_tenant_and_events_block_for_news(ledger: JobLedger, store: JobStore) -> None:
    jobs = [ledger.submit(two_stage_job(tenant="t1" if i < 3 else "t2"), ["ar"])[0] for i in range(4)]
    ledger.cancel(jobs[1].id)
    page = ledger.page(limit=2, tenant="t1")
    rest = ledger.page(limit=10, cursor=page.next_cursor, tenant="t1")
    assert [j.id for j in page.jobs + rest.jobs] == [jobs[2].id, jobs[1].id, jobs[0].id]
    assert [j.id for j in ledger.page(limit=10, status=JobStatus.canceled).jobs] == [jobs[1].id]
    last = ledger.events(jobs[0].id)[-1].id
    assert ledger.events(jobs[0].id, after=last, block_ms=50) == []
    waiter: list[list[object]] = []
    thread = threading.Thread(target=lambda: waiter.append(ledger.events(jobs[0].id, after=last, block_ms=5000)))
    thread.start()
    time.sleep(0.1)
    ledger.cancel(jobs[0].id)
    thread.join(5)
    assert [e.type for e in waiter[0]] == ["job.canceled"]  # type: ignore[attr-defined]


def test_retention_reads_and_deletes_a_whole_job(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(two_stage_job(webhook=JobWebhook(url="https://example.com/h")), ["ar"])
    start(ledger, claim(store)[0])  # a `start` webhook message exists now
    assert job.id in store.job_ids_created(after=None, until=now() + 1)
    assert store.job_ids_created(after=now() + 1, until=float("inf")) == []
    store.delete(job.id)
    assert ledger.get(job.id) is None and ledger.events(job.id) == [] and store.webhook_slots(job.id) == {}
    assert ledger.page(limit=10).jobs == [] and store.job_ids_created(after=None, until=now() + 1) == []
    store.set_mark("omni:test:mark", "12.5")
    assert store.get_mark("omni:test:mark") == "12.5"


def test_locks_and_throttles_expire(store: JobStore) -> None:
    assert store.try_lock("omni:test:lock", "me", 0.2) and not store.try_lock("omni:test:lock", "you", 0.2)
    assert store.throttle("t", 0.2) and not store.throttle("t", 0.2)
    time.sleep(0.3)
    assert store.try_lock("omni:test:lock", "you", 0.2) and store.throttle("t", 0.2)


def test_many_writers_on_one_job_lose_no_update(ledger: JobLedger, store: JobStore) -> None:
    job, _ = ledger.submit(fan_in_job(), ["a", "b"])
    steps = {s.stage_id: s for s in claim(store) if isinstance(s, RunStage)}
    a, b = start(ledger, steps["a"], "w1#1"), start(ledger, steps["b"], "w2#1")

    def report(taken: Acquired) -> None:
        for step in range(50):
            assert ledger.progress(taken.lease, taken.job, step, 50, "tokens") == "ok"

    threads = [threading.Thread(target=report, args=(t,)) for t in (a, b)]
    threads += [threading.Thread(target=ledger.renew, args=([a.lease, b.lease],)) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    progress = [e for e in ledger.events(job.id, count=1000) if e.type == EventType.stage_progress]
    assert len(progress) == 100
    ledger.complete_stage(a.lease, {}, {})
    ledger.complete_stage(b.lease, {}, {})
    assert claim(store) == [RunStage(job.id, "c", 1, "dit")]


def test_renewals_and_progress_of_many_leases_go_together_and_each_is_judged_on_its_own(
        ledger: JobLedger, store: JobStore) -> None:
    """A worker renews all its leases, and writes all its batch members' progress, in one round trip
    (commit_each): a lost lease among them is reported alone, the others are extended/written."""
    jobs = [ledger.submit(two_stage_job(), ["ar"])[0] for _ in range(3)]
    taken = [start(ledger, step, f"w1#{i}") for i, step in enumerate(claim(store))]
    assert len(taken) == 3
    lost = taken[1]
    _expire_now(store, ledger, lost.lease)
    assert ledger.expire(lost.lease.slot) == "requeued"  # the reaper took it back
    before = {t.lease.slot: store.get(t.lease.job_id).stage_record("ar").lease_until for t in taken}
    time.sleep(0.01)
    assert ledger.renew([t.lease for t in taken]) == [lost.lease]
    for t in (taken[0], taken[2]):
        assert store.get(t.lease.job_id).stage_record("ar").lease_until > before[t.lease.slot]
    outcomes = ledger.progress_many([(t.lease, t.job, 5, 10, "steps") for t in taken])
    assert outcomes == ["ok", "lost", "ok"]
    steps = {j.id: [e.data["step"] for e in ledger.events(j.id) if e.type is EventType.stage_progress] for j in jobs}
    assert [steps[t.lease.job_id] for t in taken] == [[5], [], [5]]
    assert store.commit_each([]) == []


def test_starts_and_completions_made_at_once_each_get_their_own_answer(ledger: JobLedger, store: JobStore) -> None:
    """A batch's members start and finish together from many threads (the Redis store sends such
    commits together: omni_jobs.jobs.group_commit). Each start is judged on its own: every job's
    awaited attempt starts once, a second worker's try at the same step is refused, and each thread
    gets its own job's answer back."""
    jobs = [ledger.submit(two_stage_job(), ["ar"])[0] for _ in range(16)]
    steps = [s for s in claim(store) if isinstance(s, RunStage)]
    assert len(steps) == 16
    taken: dict[tuple[str, str], Acquired | Refused] = {}
    gate = threading.Barrier(32)

    def take(step: RunStage, owner: str) -> None:
        gate.wait(10)
        taken[(step.job_id, owner)] = ledger.acquire(step, worker=owner.split("#")[0], owner=owner)

    threads = [threading.Thread(target=take, args=(s, o)) for s in steps for o in ("w1#1", "w2#1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for job in jobs:
        answers = [taken[(job.id, o)] for o in ("w1#1", "w2#1")]
        won = [a for a in answers if isinstance(a, Acquired)]
        assert len(won) == 1 and won[0].job.id == job.id and won[0].lease.job_id == job.id, answers
        assert sum(isinstance(a, Refused) for a in answers) == 1

    finished: dict[str, Job | Refused] = {}

    def finish(acquired: Acquired) -> None:
        gate.wait(10)
        finished[acquired.job.id] = ledger.complete_stage(acquired.lease, {"text": ref("t")}, {})

    gate = threading.Barrier(16)
    winners = [a for a in taken.values() if isinstance(a, Acquired)]
    threads = [threading.Thread(target=finish, args=(a,)) for a in winners]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert {job_id: done.id for job_id, done in finished.items() if isinstance(done, Job)} == {j.id: j.id for j in jobs}
    assert sorted(s.job_id for s in claim(store) if isinstance(s, RunStage) and s.stage_id == "dit") == \
        sorted(j.id for j in jobs)
