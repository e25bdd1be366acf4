"""MemoryJobStore keeps JobStore's contract: atomic updates, ordered events, one claim per stage."""

from __future__ import annotations

import threading
import time

import pytest

from omni_jobs.errors import JobNotFound
from omni_jobs.jobs import state
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.models import Job, JobEvent, JobStatus, StageRecord, now


def new_job(job_id: str = "job_1") -> Job:
    return Job(id=job_id, pipeline="p", input={"prompt": "x"}, stages=[StageRecord(id="ar", engine="ar", queue="ar")])


def test_get_returns_copies_and_update_commits() -> None:
    store = MemoryJobStore()
    store.create(new_job(), [JobEvent(job_id="job_1", type="job.queued")])
    copy = store.require("job_1")
    copy.input["prompt"] = "changed"
    assert store.require("job_1").input == {"prompt": "x"}
    _, events = store.update("job_1", lambda j: state.stage_queued(j, "ar", now()))
    assert [e.type for e in events] == ["stage.queued"] and store.require("job_1").stage_record("ar").queued_at


def test_failed_mutation_writes_nothing() -> None:
    store = MemoryJobStore()
    store.create(new_job(), [])

    def boom(job: Job) -> list[JobEvent]:
        job.input["prompt"] = "half-done"
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        store.update("job_1", boom)
    assert store.require("job_1").input == {"prompt": "x"} and store.events("job_1") == []
    with pytest.raises(JobNotFound):
        store.update("job_missing", boom)


def test_concurrent_updates_are_not_lost() -> None:
    store = MemoryJobStore()
    store.create(new_job(), [])

    def bump(job: Job) -> list[JobEvent]:
        job.input["n"] = job.input.get("n", 0) + 1
        return []

    threads = [threading.Thread(target=lambda: [store.update("job_1", bump) for _ in range(200)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.require("job_1").input["n"] == 800


def test_events_are_ordered_and_can_be_waited_for() -> None:
    store = MemoryJobStore()
    store.create(new_job(), [JobEvent(job_id="job_1", type="job.queued")])
    first = store.events("job_1")
    assert [e.type for e in first] == ["job.queued"] and first[0].id == "1-0"
    assert store.events("job_1", after=first[0].id, block_ms=50) == []

    def later() -> None:
        time.sleep(0.1)
        store.update("job_1", lambda j: state.stage_queued(j, "ar", now()))

    threading.Thread(target=later).start()
    started = time.monotonic()
    waited = store.events("job_1", after=first[0].id, block_ms=5000)
    assert [e.type for e in waited] == ["stage.queued"] and time.monotonic() - started < 4


def test_claims_listing_and_listeners() -> None:
    store = MemoryJobStore()
    seen: list[str] = []
    store.listeners.append(lambda job, events: seen.extend(e.type for e in events))
    for i in range(3):
        store.create(new_job(f"job_{i}"), [JobEvent(job_id=f"job_{i}", type="job.queued")])
    assert seen == ["job.queued"] * 3
    assert store.claim_enqueue("job_0", "ar") and not store.claim_enqueue("job_0", "ar")
    page = store.page(limit=2)
    assert [j.id for j in page.jobs] == ["job_2", "job_1"] and page.next_cursor == "2"
    assert [j.id for j in store.page(limit=2, cursor=page.next_cursor).jobs] == ["job_0"]
    assert store.page(limit=5, status=JobStatus.succeeded).jobs == []
    assert store.queue_position(store.require("job_0")) is None
    store.delete("job_0")
    assert store.get("job_0") is None and store.claim_enqueue("job_0", "ar")
