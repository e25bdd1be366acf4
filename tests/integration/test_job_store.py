"""JobStore on a real Redis: atomic updates under concurrency, events, listing, claims."""

from __future__ import annotations

import threading

import pytest
import redis

from omni_jobs.errors import JobNotFound
from omni_jobs.jobs import state
from omni_jobs.jobs.models import JobEvent, JobStatus
from omni_jobs.jobs.store import JobStore
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.submission import build_job, resolve_params

T2I = load_catalogue().get("text-to-image")


def make_job(store: JobStore, prompt: str = "x"):
    job = build_job(T2I, {"prompt": prompt}, resolve_params(T2I, {}))
    store.create(job, [JobEvent(job_id=job.id, type="job.queued")])
    return job


def test_create_get_and_ttl(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client, ttl_s=120)
    job = make_job(store)
    loaded = store.require(job.id)
    assert loaded == job
    assert 0 < redis_client.ttl(f"omni:job:{job.id}") <= 120
    with pytest.raises(JobNotFound):
        store.require("job_missing")


def test_concurrent_updates_are_not_lost(redis_client: redis.Redis) -> None:
    """Eight threads each record 25 progress steps; the attempt counter sees every update."""
    store = JobStore(redis_client, ttl_s=120)
    job = make_job(store)
    store.update(job.id, lambda j: state.stage_queued(j, "ar", 1.0))

    def bump(j):
        j.stage_record("ar").attempts += 1
        return []

    def worker() -> None:
        for _ in range(25):  # each update checks out its own connection from the shared pool
            store.update(job.id, bump)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.require(job.id).stage_record("ar").attempts == 200


def test_events_stream_in_order_and_blocking_read(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client, ttl_s=120)
    job = make_job(store)
    store.update(job.id, lambda j: state.stage_queued(j, "ar", 1.0))
    store.update(job.id, lambda j: state.stage_started(j, "ar", "w", 2.0))
    events = store.events(job.id)
    assert [e.type for e in events] == ["job.queued", "stage.queued", "job.running", "stage.started"]
    assert store.events(job.id, after=events[-1].id, block_ms=50) == []


def test_failed_mutation_writes_nothing(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client, ttl_s=120)
    job = make_job(store)

    def explode(j):
        j.status = JobStatus.failed
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        store.update(job.id, explode)
    assert store.require(job.id).status is JobStatus.queued


def test_list_newest_first_with_cursor_and_status(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client, ttl_s=120)
    jobs = [make_job(store, f"p{i}") for i in range(5)]
    page = store.page(limit=2)
    assert [j.id for j in page.jobs] == [jobs[4].id, jobs[3].id] and page.next_cursor
    rest = store.page(limit=10, cursor=page.next_cursor)
    assert [j.id for j in rest.jobs] == [j.id for j in jobs[2::-1]] and rest.next_cursor is None
    store.update(jobs[1].id, lambda j: state.job_canceled(j, 3.0))
    assert [j.id for j in store.page(limit=10, status=JobStatus.canceled).jobs] == [jobs[1].id]
    redis_client.delete(f"omni:job:{jobs[0].id}")  # expired: dropped from the index on the next list
    assert jobs[0].id not in [j.id for j in store.page(limit=10).jobs]


def test_claim_enqueue_is_once(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client, ttl_s=120)
    assert store.claim_enqueue("job_a", "dit") is True
    assert store.claim_enqueue("job_a", "dit") is False
    assert store.claim_enqueue("job_a", "ar") is True
