"""Retention on a real Redis and a real directory store: what expires goes, what does not stays; and
the reaper pass that cleanup runs brings back the steps of workers that died."""

from __future__ import annotations

import time
from pathlib import Path

import redis

from omni_jobs.accept.submission import build_job, resolve_params
from omni_jobs.artifacts import ArtifactStore, LocalBackend, RedisBackend
from omni_jobs.core import keys
from omni_jobs.dispatch.leases import Reaper
from omni_jobs.dispatch.retention import cleanup
from omni_jobs.dispatch.scheduling import Scheduler
from omni_jobs.jobs.ledger import Acquired, JobLedger
from omni_jobs.jobs.models import EventType, Job, JobStatus, StageStatus, now
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import AssembleResults, RunStage, Step
from omni_jobs.local.devservices import RunningService
from omni_jobs.pipelines.catalogue import load_catalogue

T2T = load_catalogue().get("text-to-text")
DAY = 24 * 3600.0
NOW = 1_000_000_000.0


def take(ledger: JobLedger, step: Step, owner: str = "w#1") -> Acquired:
    taken = ledger.acquire(step, worker=owner.split("#")[0], owner=owner)
    assert isinstance(taken, Acquired), taken
    return taken


def stored_job(ledger: JobLedger, artifacts: ArtifactStore, created_at: float, *, finished: bool = True,
               deadline_at: float | None = None) -> str:
    """A text-to-text job created at ``created_at``, with an output and a large intermediate; run to
    the end through the ledger when ``finished``, else still waiting for its stage."""
    job = build_job(T2T, {"prompt": "x"}, resolve_params(T2T, {}))
    job.created_at = created_at
    job.deadline_at = deadline_at
    ledger.submit(job, ["ar"])
    if finished:
        ar = take(ledger, RunStage(job.id, "ar", 1, "ar"))
        ledger.complete_stage(ar.lease, {}, {})
        results = take(ledger, AssembleResults(job.id, 1))
        done = ledger.complete_results(results.lease, [])
        assert isinstance(done, Job) and done.status is JobStatus.succeeded
    artifacts.put_output(keys.output_artifact(job.id, "text.json"), b'{"text":"x"}', "application/json")
    big = b"x" * 4096  # over the Redis threshold: lands in the directory, which has no TTL
    artifacts.put_intermediate(keys.intermediate_artifact(job.id, "ar", "text.json", 1), big, "application/json")
    return job.id


def test_cleanup_removes_expired_jobs_and_intermediates_and_cancels_overdue(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = RedisJobStore(redis_client, ttl_s=int(30 * DAY))
    ledger = JobLedger(store)
    artifacts = ArtifactStore(LocalBackend(tmp_path), RedisBackend(redis_client), small_max_bytes=1024)
    ancient = stored_job(ledger, artifacts, NOW - 8 * DAY)  # past the 7-day output TTL
    old = stored_job(ledger, artifacts, NOW - 2 * DAY)  # past the 1-day intermediate TTL only
    old_running = stored_job(ledger, artifacts, NOW - 2 * DAY, finished=False)
    fresh = stored_job(ledger, artifacts, NOW - 60)
    overdue = stored_job(ledger, artifacts, NOW - 120, finished=False, deadline_at=NOW - 1)
    Scheduler(store, None).release_all()  # (no relay here: their first steps wait in the outbox)
    waiting = {f"stage:{job_id}:ar:1" for job_id in (old_running, overdue)}
    assert store.outbox_holds(sorted(waiting)) == waiting  # their first steps are still to be published

    report = cleanup(ledger, artifacts, output_ttl_s=7 * DAY, intermediate_ttl_s=DAY, at=NOW)

    assert report.jobs_expired == 1 and report.artifacts_deleted == 2
    assert store.get(ancient) is None and not list(tmp_path.glob(f"jobs/{ancient}/**/*.json"))
    assert redis_client.zscore(keys.JOBS_INDEX, ancient) is None
    assert not redis_client.exists(keys.job(ancient), keys.job_events(ancient))
    assert report.intermediates_deleted == 1
    assert not (tmp_path / "jobs" / old / "stages").exists() and (tmp_path / "jobs" / old / "outputs").exists()
    assert (tmp_path / "jobs" / old_running / "stages" / "ar" / "attempt-1").exists()  # not finished: kept
    assert (tmp_path / "jobs" / fresh / "stages").exists()
    assert report.deadlines_canceled == 1
    job = ledger.require(overdue)
    assert job.status is JobStatus.canceled and job.stage_record("ar").status is StageStatus.canceled
    assert ledger.events(overdue)[-1].data["reason"] == "deadline exceeded (cancel_after)"
    # The canceled job's step is not published any more; the running one's still is.
    assert store.outbox_holds(sorted(waiting)) == {f"stage:{old_running}:ar:1"}
    assert store.queue_counts("ar") == (1, 0)
    assert (report.steps_requeued, report.steps_redispatched) == (0, 0)  # no reaper given

    again = cleanup(ledger, artifacts, output_ttl_s=7 * DAY, intermediate_ttl_s=DAY, at=NOW)
    assert (again.jobs_expired, again.intermediates_deleted, again.deadlines_canceled) == (0, 0, 0)
    # The running job is revisited once it finishes.
    ledger.cancel(old_running)
    later = cleanup(ledger, artifacts, output_ttl_s=7 * DAY, intermediate_ttl_s=DAY,
                    at=NOW + 10)
    assert later.intermediates_deleted == 1 and not (tmp_path / "jobs" / old_running / "stages").exists()


def test_cleanup_brings_back_the_steps_of_dead_workers(redis_service: RunningService, tmp_path: Path) -> None:
    """With no worker left to run a reaper, cleanup's pass does: an expired lease queues the next
    attempt; a waiting step whose message the broker lost is published again. On a DB of its own: a
    relay another test left on DB 0 would publish the outbox under this test's feet."""
    redis_client = redis.Redis.from_url(f"redis://127.0.0.1:{redis_service.port}/12")
    redis_client.flushdb()
    store = RedisJobStore(redis_client, ttl_s=3600)
    ledger = JobLedger(store, lease_s=0.05)
    artifacts = ArtifactStore(LocalBackend(tmp_path))
    reaper = Reaper(ledger, store, owner="cleanup", queues=lambda: ["ar"], queue_depth=lambda _queue: 0,
                    dispatch_timeout_s=0.0, interval_s=0.1)

    def one_pass() -> tuple[int, int]:
        time.sleep(0.25)  # past the lease, and past the previous pass's lock
        report = cleanup(ledger, artifacts, output_ttl_s=DAY, intermediate_ttl_s=DAY,
                         reaper=reaper)
        return report.steps_requeued, report.steps_redispatched

    job_id = stored_job(ledger, artifacts, now(), finished=False)
    store.ack_outbox([f"stage:{job_id}:ar:1"])  # published
    take(ledger, RunStage(job_id, "ar", 1, "ar"), "w1#1")  # and started by a worker that then died
    assert one_pass() == (1, 0)
    record = ledger.require(job_id).stage_record("ar")
    assert record.status is StageStatus.queued and record.attempts == 1 and record.lease_owner is None
    (requeued,) = [e for e in ledger.events(job_id) if e.type is EventType.stage_requeued]
    assert requeued.data["attempt"] == 1 and "lease expired" in requeued.data["reason"]
    retry = RunStage(job_id, "ar", 2, "ar")
    assert store.outbox_holds([f"stage:{job_id}:ar:2"]) == {f"stage:{job_id}:ar:2"}
    assert one_pass() == (0, 0)  # still in the outbox: nothing was lost, nothing to publish again

    Scheduler(store, None).release_all()  # first attempts wait for their turn
    entries = store.claim_outbox(now=now(), limit=10, hold_s=60.0, job_id=job_id)
    assert [e.step for e in entries] == [retry]
    store.ack_outbox([e.id for e in entries])  # published, then lost by the broker (its queue is empty)
    assert one_pass() == (0, 1)
    Scheduler(store, None).release_all()  # first attempts wait for their turn
    assert [e.step for e in store.claim_outbox(now=now(), limit=10, hold_s=60.0, job_id=job_id)] == [retry]
    assert ledger.require(job_id).stage_record("ar").attempts == 1  # only dispatched again, not run


def test_an_expired_job_that_never_ran_leaves_nothing_waiting(redis_client: redis.Redis, tmp_path: Path) -> None:
    """No worker ever took it: once retention deletes it, its step must not stay on its queue's waiting
    index (queue metrics and autoscaling would count it forever) nor in the outbox."""
    store = RedisJobStore(redis_client, ttl_s=int(30 * DAY))
    ledger = JobLedger(store)
    artifacts = ArtifactStore(LocalBackend(tmp_path))
    never_ran = stored_job(ledger, artifacts, NOW - 8 * DAY, finished=False)
    assert store.queue_counts("ar") == (1, 0)
    report = cleanup(ledger, artifacts, output_ttl_s=7 * DAY, intermediate_ttl_s=DAY, at=NOW)
    assert report.jobs_expired == 1 and store.get(never_ran) is None
    assert store.queue_counts("ar") == (0, 0)
    assert store.outbox_holds([f"stage:{never_ran}:ar:1"]) == set()
