"""The async submit path (the API's), on both stores: JobLedger.asubmit makes the same one write as
submit (the same decision, _plan_submit), and the stores' async methods answer as their sync ones."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from omni_jobs.core import keys
from omni_jobs.core.errors import IdempotencyConflict, Overloaded, QuotaExceeded
from omni_jobs.jobs.change import Change
from omni_jobs.jobs.flows import Commit, CommitPlaced, Get, Idempotency, QueuePosition
from omni_jobs.jobs.ledger import JobLedger, QueueLimit, Quota
from omni_jobs.jobs.steps import RunStage
from omni_jobs.jobs.store import JobStore
from tests.contract.test_job_state_contract import claim, two_stage_job

T = TypeVar("T")


def run(store: JobStore, make: Callable[[], Awaitable[T]]) -> T:
    """Run on a fresh event loop, closing the store's client of that loop after."""

    async def main() -> T:
        try:
            return await make()
        finally:
            await store.aclose()

    return asyncio.run(main())


def test_asubmit_stores_what_submit_stores_and_answers_the_queue_position(ledger: JobLedger, store: JobStore) -> None:
    done = run(store, lambda: ledger.asubmit(two_stage_job(), ["ar"]))
    assert done.created and done.queue_position == 1
    stored = ledger.require(done.job.id)
    assert stored == done.job
    assert [e.type for e in ledger.events(done.job.id)] == ["job.queued", "stage.queued"]
    assert claim(store) == [RunStage(done.job.id, "ar", 1, "ar")]
    assert store.queue_counts("ar") == (1, 0)
    second = run(store, lambda: ledger.asubmit(two_stage_job(), ["ar"]))
    assert second.queue_position == store.queue_position(second.job) == 2
    # The async reads answer as the sync ones.
    assert run(store, lambda: store.arun(Get(done.job.id))) == store.get(done.job.id)
    assert run(store, lambda: store.arun(QueuePosition(second.job))) == 2
    assert run(store, lambda: store.arun(Get("job_missing"))) is None


def test_asubmit_replays_an_idempotency_key_and_refuses_another_body(ledger: JobLedger, store: JobStore) -> None:
    first = run(store, lambda: ledger.asubmit(two_stage_job(), ["ar"], idempotency=("k", "fp-a")))
    again = run(store, lambda: ledger.asubmit(two_stage_job(), ["ar"], idempotency=("k", "fp-a")))
    assert first.created and not again.created and again.job.id == first.job.id
    assert again.queue_position == first.queue_position == 1
    with pytest.raises(IdempotencyConflict, match=first.job.id):
        run(store, lambda: ledger.asubmit(two_stage_job(), ["ar"], idempotency=("k", "fp-b")))
    record = run(store, lambda: store.arun(Idempotency("t1", "k")))
    assert record == store.idempotency("t1", "k") and record is not None and record.job_id == first.job.id
    assert run(store, lambda: store.arun(Idempotency("t1", "other"))) is None
    assert len(ledger.page(limit=10).jobs) == 1 and len(claim(store)) == 1  # the refused ones wrote nothing


def test_asubmit_checks_quotas_in_its_write(ledger: JobLedger, store: JobStore) -> None:
    quota = Quota(max_active=1)
    run(store, lambda: ledger.asubmit(two_stage_job(tenant="q"), ["ar"], quota=quota))
    with pytest.raises(QuotaExceeded) as refused:
        run(store, lambda: ledger.asubmit(two_stage_job(tenant="q"), ["ar"], quota=quota))
    assert refused.value.limit == "max_active" and refused.value.value == 1
    rate = Quota(per_minute=1)
    run(store, lambda: ledger.asubmit(two_stage_job(tenant="r"), ["ar"], quota=rate))
    with pytest.raises(QuotaExceeded) as rated:
        run(store, lambda: ledger.asubmit(two_stage_job(tenant="r"), ["ar"], quota=rate))
    assert rated.value.limit == "jobs_per_minute" and 1 <= rated.value.retry_after_s <= 60
    assert store.count(keys.tenant_active("q")) == 1 and store.count(keys.tenant_active("r")) == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_entry_queue_refuses_the_job_in_the_same_write(ledger: JobLedger, store: JobStore, mode: str) -> None:
    limit = [QueueLimit("ar", 2, 7)]

    def submit(tenant: str) -> object:
        if mode == "sync":
            return ledger.submit(two_stage_job(tenant=tenant), ["ar"], queue_limits=limit)
        return run(store, lambda: ledger.asubmit(two_stage_job(tenant=tenant), ["ar"], queue_limits=limit))

    submit("a")
    submit("b")
    with pytest.raises(Overloaded) as full:
        submit("c")  # any tenant: the queue is full
    assert (full.value.queue, full.value.depth, full.value.limit, full.value.retry_after_s) == ("ar", 2, 2, 7)
    assert store.queue_counts("ar") == (2, 0) and len(ledger.page(limit=10).jobs) == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_replay_is_answered_where_a_new_job_would_be_refused(ledger: JobLedger, store: JobStore, mode: str) -> None:
    """The write finds an Idempotency-Key's replay (no read before it); a full queue or a spent quota
    still answers the replay with its job, and a different body with IdempotencyConflict."""
    limit, quota = [QueueLimit("ar", 1, 7)], Quota(max_active=1)

    def submit(fingerprint: str) -> tuple[str, bool]:
        if mode == "sync":
            job, created = ledger.submit(two_stage_job(), ["ar"], idempotency=("k", fingerprint), quota=quota,
                                         queue_limits=limit)
            return job.id, created
        done = run(store, lambda: ledger.asubmit(two_stage_job(), ["ar"], idempotency=("k", fingerprint),
                                                   quota=quota, queue_limits=limit))
        return done.job.id, done.created

    first, created = submit("fp-a")
    assert created
    assert submit("fp-a") == (first, False)  # the queue is full and the quota spent: a new job is refused
    with pytest.raises(Overloaded):
        if mode == "sync":
            ledger.submit(two_stage_job(), ["ar"], quota=quota, queue_limits=limit)
        else:
            run(store, lambda: ledger.asubmit(two_stage_job(), ["ar"], quota=quota, queue_limits=limit))
    with pytest.raises(IdempotencyConflict, match=first):
        submit("fp-b")
    assert store.queue_counts("ar") == (1, 0) and len(ledger.page(limit=10).jobs) == 1


def test_arun_commit_answers_as_commit(store: JobStore) -> None:
    key = f"{keys.PREFIX}:test:acommit"
    assert run(store, lambda: store.arun(Commit(Change().expect(key, "v", None).hset(key, {"v": "1"})))) is None
    conflict = run(store, lambda: store.arun(Commit(Change().expect(key, "v", None).hset(key, {"v": "2"}))))
    assert conflict is not None and conflict.guard is not None and conflict.found == "1"
    assert store.commit(Change().expect(key, "v", None)) == conflict
    capped = run(store, lambda: store.arun(Commit(Change().zadd(f"{key}:z", "m", 1.0))))
    assert capped is None
    over = run(store, lambda: store.arun(Commit(Change().cap(f"{key}:z", 1, name="n").zadd(f"{key}:z", "x", 2.0))))
    assert over is not None and over.cap is not None and over.found == "1"
    placed = run(store, lambda: store.arun(CommitPlaced(Change().cap(f"{key}:z", 1), two_stage_job())))
    assert placed[0] is not None and placed[1] is None


@pytest.mark.integration
def test_asubmit_loads_the_commit_script_again_after_a_redis_restart(redis_client: object) -> None:
    import redis

    from omni_jobs.jobs.redis_store import RedisJobStore

    assert isinstance(redis_client, redis.Redis)
    store = RedisJobStore(redis_client, ttl_s=3600)
    ledger = JobLedger(store)

    async def twice() -> tuple[bool, bool]:
        try:
            first = await ledger.asubmit(two_stage_job(), ["ar"])
            await store._aclient().script_flush()  # what a restarted server without the script looks like
            second = await ledger.asubmit(two_stage_job(), ["ar"])
            return first.created, second.created
        finally:
            await store.aclose()

    assert asyncio.run(twice()) == (True, True)
    assert store.queue_counts("ar") == (2, 0)


def test_asubmit_writes_nothing_when_a_required_field_does_not_hold(ledger: JobLedger, store: JobStore) -> None:
    from omni_jobs.jobs.change import Guard
    from omni_jobs.jobs.ledger import RequirementFailed

    record = f"{keys.PREFIX}:test:key"
    store.commit(Change().hset(record, {"revoked": "0"}))
    requires = [Guard(record, "revoked", ("0", None))]
    assert run(store, lambda: ledger.asubmit(two_stage_job(), ["ar"], requires=requires)).created
    store.commit(Change().hset(record, {"revoked": "1"}))
    with pytest.raises(RequirementFailed):
        run(store, lambda: ledger.asubmit(two_stage_job(), ["ar"], requires=requires, idempotency=("k", "fp")))
    assert len(ledger.page(limit=10).jobs) == 1 and store.idempotency("t1", "k") is None
