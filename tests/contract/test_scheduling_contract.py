"""Scheduling on both stores: the release window, tenants taking turns, priority with aging, and
quotas checked in the submit's own write."""

from __future__ import annotations

import time

import pytest

from omni_jobs.core import keys
from omni_jobs.core.errors import QuotaExceeded
from omni_jobs.jobs.change import Change, ReleasePass
from omni_jobs.jobs.ledger import Acquired, JobLedger, Quota
from omni_jobs.jobs.models import Job, Priority, StageRecord, new_job_id, now
from omni_jobs.jobs.steps import RunStage
from omni_jobs.jobs.store import JobStore


def dit_job(tenant: str, priority: Priority = Priority.normal) -> Job:
    return Job(id=new_job_id(), pipeline="dit-only", input={}, tenant=tenant, priority=priority,
               stages=[StageRecord(id="dit", engine="dit", queue="dit")])


def releases(store: JobStore, window: int) -> list[str]:
    """One release pass on the dit queue; the job ids it released, in order."""
    return [entry.split(":")[1] for entry, _tenant in store.release({"dit": window}, now=now()).released]


def run_to_end(ledger: JobLedger, job_id: str) -> None:
    taken = ledger.acquire(RunStage(job_id, "dit", 1, "dit"), worker="w", owner="w#1")
    assert isinstance(taken, Acquired), taken
    ledger.complete_stage(taken.lease, {}, {})


def test_nothing_is_released_beyond_the_window(ledger: JobLedger, store: JobStore) -> None:
    jobs = [ledger.submit(dit_job("a"), ["dit"])[0].id for _ in range(5)]
    assert store.claim_outbox(now=now(), limit=10, hold_s=1) == []  # first attempts wait for the scheduler
    assert releases(store, window=2) == jobs[:2]
    assert releases(store, window=2) == []  # two released, none started: the window is full
    run_to_end(ledger, jobs[0])  # started (released -> running), then done: one place frees
    assert releases(store, window=2) == [jobs[2]]
    assert store.queue_counts("dit") == (4, 0)  # waiting: two released, two ready
    published = store.claim_outbox(now=now(), limit=10, hold_s=1)
    assert {e.step.job_id for e in published if isinstance(e.step, RunStage)} == {jobs[1], jobs[2]}  # started: gone


def test_one_pass_releases_on_every_queue_each_within_its_window(ledger: JobLedger, store: JobStore) -> None:
    dit = [ledger.submit(dit_job("a"), ["dit"])[0].id for _ in range(3)]
    ar = [ledger.submit(Job(id=new_job_id(), pipeline="ar-only", input={}, tenant="a",
                            stages=[StageRecord(id="ar", engine="ar", queue="ar")]), ["ar"])[0].id for _ in range(3)]
    released = store.release({"dit": 2, "ar": 1, "idle": 4}, now=now()).released
    assert sorted(entry.split(":")[1] for entry, _ in released) == sorted(dit[:2] + ar[:1])
    assert store.release({"dit": 2, "ar": 1}, now=now()).released == []  # both windows full
    assert store.release({}, now=now()) == ReleasePass([], frozenset())


def test_a_pass_names_the_queues_it_left_full(ledger: JobLedger, store: JobStore) -> None:
    dit = [ledger.submit(dit_job("a"), ["dit"])[0].id for _ in range(3)]
    first = store.release({"dit": 2, "ar": 1, "idle": 4}, now=now())
    assert [entry.split(":")[1] for entry, _ in first.released] == dit[:2]
    assert first.full == {"dit"}  # two of two in service; ar and idle have room (nothing waits there)
    run_to_end(ledger, dit[0])
    second = store.release({"dit": 2, "ar": 0}, now=now())  # a window of 0: no worker takes the queue
    assert [entry.split(":")[1] for entry, _ in second.released] == [dit[2]]
    assert second.full == {"dit", "ar"}
    run_to_end(ledger, dit[1])
    assert store.release({"dit": 2}, now=now()) == ReleasePass([], frozenset())  # one in service, room for one


def test_tenants_take_turns_whatever_their_backlog(ledger: JobLedger, store: JobStore) -> None:
    a = [ledger.submit(dit_job("tenant-a"), ["dit"])[0].id for _ in range(10)]
    b = [ledger.submit(dit_job("tenant-b"), ["dit"])[0].id for _ in range(3)]
    order: list[str] = []
    for _ in range(13):  # one worker, one task at a time: each release waits for the previous to end
        (released,) = releases(store, window=1)
        order.append(released)
        run_to_end(ledger, released)
    assert order[:6] == [a[0], b[0], a[1], b[1], a[2], b[2]]
    assert order[6:] == a[3:]


def test_a_high_job_goes_first_and_a_low_one_is_passed_only_for_the_aging_time(store: JobStore) -> None:
    ledger = JobLedger(store, priority_aging_s=60.0)
    normal = [ledger.submit(dit_job("t"), ["dit"])[0].id for _ in range(3)]
    high = ledger.submit(dit_job("t", Priority.high), ["dit"])[0].id
    low = ledger.submit(dit_job("t", Priority.low), ["dit"])[0].id
    later = dit_job("t")
    later.created_at = now() + 30  # queued 30 s after the low one: within its aging, so it goes first
    ledger.submit(later, ["dit"])
    much_later = dit_job("t")
    much_later.created_at = now() + 90  # queued past the low one's aging: after it
    ledger.submit(much_later, ["dit"])
    assert releases(store, window=10) == [high, *normal, later.id, low, much_later.id]


def test_a_job_canceled_before_its_turn_is_never_released(ledger: JobLedger, store: JobStore) -> None:
    first, second = (ledger.submit(dit_job("t"), ["dit"])[0].id for _ in range(2))
    ledger.cancel(first)
    assert releases(store, window=5) == [second]
    assert store.queue_counts("dit") == (1, 0)


def test_queue_position_counts_released_work_and_the_tenants_turns(ledger: JobLedger, store: JobStore) -> None:
    a = [ledger.submit(dit_job("a"), ["dit"])[0].id for _ in range(4)]
    b = [ledger.submit(dit_job("b"), ["dit"])[0].id for _ in range(2)]
    releases(store, window=2)  # a[0] then b[0]
    assert [ledger.queue_position(ledger.require(i)) for i in (a[0], b[0])] == [1, 2]
    # Ready: 2 released ahead, then the two tenants take turns.
    assert [ledger.queue_position(ledger.require(i)) for i in (a[1], b[1], a[2], a[3])] == [3, 3, 5, 7]


def test_a_quota_refuses_the_job_in_the_same_write(ledger: JobLedger, store: JobStore) -> None:
    quota = Quota(max_active=2)
    first = ledger.submit(dit_job("q"), ["dit"], quota=quota)[0]
    ledger.submit(dit_job("q"), ["dit"], quota=quota)
    with pytest.raises(QuotaExceeded) as refused:
        ledger.submit(dit_job("q"), ["dit"], quota=quota)
    assert refused.value.limit == "max_active" and refused.value.value == 2 and refused.value.retry_after_s > 0
    assert len(ledger.page(limit=10, tenant="q").jobs) == 2  # nothing of the refused job was written
    assert ledger.submit(dit_job("other"), ["dit"], quota=quota)[1]  # another tenant has its own count
    ledger.cancel(first.id)  # a job that ends makes room
    assert ledger.submit(dit_job("q"), ["dit"], quota=quota)[1]


def test_a_rate_quota_says_when_the_oldest_submission_leaves_the_minute(ledger: JobLedger, store: JobStore) -> None:
    quota = Quota(per_minute=3)
    for _ in range(3):
        ledger.submit(dit_job("r"), ["dit"], quota=quota)
    time.sleep(0.2)
    with pytest.raises(QuotaExceeded) as refused:
        ledger.submit(dit_job("r"), ["dit"], quota=quota)
    assert refused.value.limit == "jobs_per_minute"
    assert 55 < refused.value.retry_after_s <= 60


def test_the_relays_pass_releases_and_claims_in_one_step(ledger: JobLedger, store: JobStore) -> None:
    jobs = [ledger.submit(dit_job("a"), ["dit"])[0].id for _ in range(3)]
    at = now()
    done, claimed = store.release_and_claim({"dit": 2}, now=at, limit=10, hold_s=30)
    assert [entry.split(":")[1] for entry, _ in done.released] == jobs[:2] and done.full == {"dit"}
    assert sorted(e.step.job_id for e in claimed) == sorted(jobs[:2])  # what it released is claimed with it
    assert done.next_due == pytest.approx(at + 30)  # the next due: a claimed entry at the end of its hold
    again, held = store.release_and_claim({"dit": 2}, now=now(), limit=10, hold_s=30)
    assert again == ReleasePass([], frozenset({"dit"})) and held == []  # held by the first claim
    store.ack_outbox([e.id for e in claimed])
    nothing, none = store.release_and_claim({}, now=now(), limit=10, hold_s=30)
    assert nothing == ReleasePass([], frozenset()) and none == [] and nothing.next_due is None  # nothing due


def test_retention_deleting_released_and_ready_jobs_never_stops_the_queue(ledger: JobLedger, store: JobStore) -> None:
    """Retention deletes jobs whose first step was released but never started (no worker came for
    a week), and jobs still waiting for their turn: their places in the window go with them, so
    the queue keeps releasing (each leftover counted against the window forever)."""
    old = [ledger.submit(dit_job("a"), ["dit"])[0].id for _ in range(3)]
    assert releases(store, window=2) == old[:2]  # two released, the third ready
    for job_id in old:
        store.delete(job_id)
    assert store.queue_counts("dit") == (0, 0)
    new = [ledger.submit(dit_job("a"), ["dit"])[0].id for _ in range(2)]
    assert releases(store, window=2) == new


def test_a_released_step_whose_job_is_gone_frees_its_place(ledger: JobLedger, store: JobStore) -> None:
    """A job's keys expired by their TTL (no cleanup ran) while its step was released: the reaper's
    look at steps that wait too long finds no job to send it again for, and frees the place."""
    gone = ledger.submit(dit_job("a"), ["dit"])[0].id
    assert releases(store, window=1) == [gone]
    store.delete(gone)  # (what an expired hash leaves: the same, without this store's own cleanup)
    store.commit(Change().zadd(keys.queue_released("dit"), f"stage:{gone}:dit", now() - 3600))
    later = ledger.submit(dit_job("a"), ["dit"])[0].id
    assert releases(store, window=1) == []  # the leftover fills the window
    assert store.released("dit", before=now(), limit=10) == [f"stage:{gone}:dit"]
    assert ledger.redispatch(f"stage:{gone}:dit", "dit") is False  # nothing to send again: its place is freed
    assert store.released("dit", before=now(), limit=10) == []
    assert releases(store, window=1) == [later]
