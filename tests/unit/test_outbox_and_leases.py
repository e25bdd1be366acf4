"""The relay, the lease keeper and the reaper, on the in-memory store: what each does when things
die around it."""

from __future__ import annotations

import threading
import time
from collections import Counter

from omni_jobs.dispatch.leases import LeaseKeeper, Reaper, lease_owner, node_of
from omni_jobs.dispatch.outbox import OutboxRelay
from omni_jobs.dispatch.scheduling import Scheduler
from omni_jobs.jobs.ledger import Acquired, JobLedger
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.models import Job, JobError, JobStatus, StageRecord, StageStatus, new_job_id, now
from omni_jobs.jobs.steps import RunStage, Step


def job() -> Job:
    return Job(id=new_job_id(), pipeline="p", input={}, stages=[StageRecord(id="ar", engine="ar", queue="ar")])


class Transport:
    """A broker stand-in that records what was published, and can be down."""

    def __init__(self) -> None:
        self.published: list[str] = []
        self.down = False
        self.lock = threading.Lock()

    def publish(self, steps: list[Step], ids: list[str]) -> None:
        if self.down:
            raise ConnectionError("broker unreachable")
        with self.lock:
            self.published.extend(ids)


def counting_passes(scheduler: Scheduler) -> Counter[str]:
    """``["release"]``: the relay's passes so far (each reads the scheduler's windows once)."""
    passes = Counter[str]()
    windows = scheduler.windows

    def counted_windows() -> dict[str, int]:
        passes["release"] += 1
        return windows()

    scheduler.windows = counted_windows  # type: ignore[method-assign]
    return passes


def test_the_relay_publishes_a_commit_at_once_and_each_entry_once() -> None:
    store = MemoryJobStore()
    ledger = JobLedger(store)
    transport = Transport()
    relay = OutboxRelay(store, transport.publish, poll_s=5.0,  # a long poll: only the wake-up can be this fast
                        scheduler=Scheduler(store, None))
    ledger.outbox_listeners.append(relay.wake)
    submitted = ledger.submit(job(), ["ar"])[0]
    deadline = time.monotonic() + 2
    while not transport.published and time.monotonic() < deadline:
        time.sleep(0.005)
    assert transport.published == [f"stage:{submitted.id}:ar:1"]
    relay.stop()


def test_a_stopped_relay_is_not_started_again_by_a_commits_wake() -> None:
    """A closed API app's relay stays stopped when a commit still reaches its ledger (a test client left on
    the app): started again, it took and published the outbox of whoever used that Redis next."""
    store = MemoryJobStore()
    ledger = JobLedger(store)
    transport = Transport()
    relay = OutboxRelay(store, transport.publish, poll_s=0.01, scheduler=Scheduler(store, None))
    ledger.outbox_listeners.append(relay.wake)
    relay.start()
    relay.stop()
    ledger.submit(job(), ["ar"])
    time.sleep(0.2)  # twenty of its polls, had it run
    assert transport.published == []
    assert not any(t.name == "omni-outbox-relay" and t.is_alive() for t in threading.enumerate()
                   if t is relay._thread)
    relay.start()  # started on purpose: it runs again
    relay.drain()
    assert len(transport.published) == 1
    relay.stop()


def test_a_commit_that_only_makes_steps_ready_wakes_the_relay_only_where_a_pass_could_release_one() -> None:
    store = MemoryJobStore()
    ledger = JobLedger(store)
    transport = Transport()
    capacity = {"ar": 0}  # the live workers' concurrency per queue: none yet
    scheduler = Scheduler(store, lambda: dict(capacity), slack=0, refresh_s=0.0)
    passes = counting_passes(scheduler)
    relay = OutboxRelay(store, transport.publish, poll_s=5.0, scheduler=scheduler)
    ledger.outbox_listeners.append(relay.wake)

    def submit_and_settle(n: int) -> list[str]:
        ids = [ledger.submit(job(), ["ar"])[0].id for _ in range(n)]
        time.sleep(0.2)
        return ids

    submit_and_settle(1)  # starts the relay: its first pass reads the capacity
    before = passes["release"]
    submit_and_settle(5)
    assert passes["release"] == before  # no worker takes "ar": no pass, nothing published
    assert transport.published == []
    capacity["ar"] = 2
    relay.wake()  # what the poll does: a pass with the new capacity
    time.sleep(0.2)
    assert len(transport.published) == 2 and scheduler._full == {"ar"}
    before = passes["release"]
    submit_and_settle(5)
    assert passes["release"] == before and len(transport.published) == 2  # the window is full: no passes
    first = transport.published[0].split(":")[1]
    taken = ledger.acquire(RunStage(first, "ar", 1, "ar"), worker="w", owner="w#1")
    assert isinstance(taken, Acquired)
    ledger.complete_stage(taken.lease, {}, {})  # a running step ends: its commit frees a place
    time.sleep(0.2)
    stages = [entry for entry in transport.published if entry.startswith("stage:")]
    assert len(stages) == 3  # the next ready step went out at once, not at the 5 s poll
    scheduler.slack = 10  # room for everything (more workers)
    relay.wake()
    time.sleep(0.2)
    assert scheduler._full == frozenset()
    assert len([entry for entry in transport.published if entry.startswith("stage:")]) == 11  # all the jobs
    last = submit_and_settle(1)[0]
    assert transport.published[-1] == f"stage:{last}:ar:1"  # woken by the commit itself, not the 5 s poll
    relay.stop()


def test_entries_wait_out_a_broker_outage_and_two_relays_never_both_publish_one() -> None:
    store = MemoryJobStore()
    ledger = JobLedger(store)
    transport = Transport()
    transport.down = True
    scheduler = Scheduler(store, None)
    first = OutboxRelay(store, transport.publish, hold_s=0.2, poll_s=0.05, scheduler=scheduler)
    ids = [ledger.submit(job(), ["ar"])[0].id for _ in range(20)]
    first.start()
    time.sleep(0.3)
    assert transport.published == []  # nothing acknowledged while the broker is away: nothing lost
    second = OutboxRelay(store, transport.publish, hold_s=0.2, poll_s=0.05, scheduler=scheduler).start()
    transport.down = False
    for _ in range(50):
        ledger.submit(job(), ["ar"])
    deadline = time.monotonic() + 5
    while len(transport.published) < 70 and time.monotonic() < deadline:
        time.sleep(0.02)
    first.stop()
    second.stop()
    counts = Counter(transport.published)
    assert len(counts) == 70 and set(counts.values()) == {1}
    assert all(f"stage:{i}:ar:1" in counts for i in ids)


def test_a_relay_that_dies_holding_entries_leaves_them_to_the_next() -> None:
    store = MemoryJobStore()
    ledger = JobLedger(store)
    submitted = ledger.submit(job(), ["ar"])[0]
    Scheduler(store, None).release_all()
    dying = store.claim_outbox(now=now(), limit=10, hold_s=0.2)  # claimed, then the process was killed
    assert len(dying) == 1
    transport = Transport()
    survivor = OutboxRelay(store, transport.publish, hold_s=0.2)
    assert survivor.run_once() == 0  # still held
    time.sleep(0.25)
    assert survivor.run_once() == 1 and transport.published == [f"stage:{submitted.id}:ar:1"]


def started(ledger: JobLedger, owner: str) -> Acquired:
    submitted = ledger.submit(job(), ["ar"])[0]
    taken = ledger.acquire(RunStage(submitted.id, "ar", 1, "ar"), worker=node_of(owner) or owner, owner=owner)
    assert isinstance(taken, Acquired)
    return taken


def test_the_keeper_renews_while_held_and_reports_a_lost_lease() -> None:
    store = MemoryJobStore()
    ledger = JobLedger(store, lease_s=0.6)
    keeper = LeaseKeeper(ledger, every_s=0.1)
    taken = started(ledger, lease_owner("ar@h"))
    lost = threading.Event()
    with keeper.hold(taken.lease, on_lost=lost.set):
        time.sleep(1.0)  # longer than the lease: it lives only because it is renewed
        record = ledger.require(taken.job.id).stage_record("ar")
        assert record.lease_until is not None and record.lease_until > now() + 0.3
        assert store.expired_leases(now=now(), limit=10) == []
        ledger.cancel(taken.job.id)
        assert lost.wait(2)
    assert keeper.held() == []


def test_the_reaper_requeues_expired_leases_one_pass_at_a_time() -> None:
    store = MemoryJobStore()
    ledger = JobLedger(store, lease_s=0.1)
    taken = started(ledger, "ar@dead#1.a")
    Scheduler(store, None).release_all()
    store.ack_outbox([e.id for e in store.claim_outbox(now=now(), limit=10, hold_s=60)])
    time.sleep(0.15)
    reapers = [Reaper(ledger, store, owner=f"r{i}", queues=lambda: ["ar"], interval_s=1.0) for i in range(2)]
    reports = [r.run_once() for r in reapers]
    assert [r.requeued for r in reports] == [1, 0]  # the second found the pass taken
    record = ledger.require(taken.job.id).stage_record("ar")
    assert record.status is StageStatus.queued
    assert [e.step for e in store.claim_outbox(now=now(), limit=10, hold_s=1)] == [RunStage(taken.job.id, "ar", 2, "ar")]


def test_after_a_store_outage_expired_leases_wait_a_grace_for_their_live_workers() -> None:
    """Every lease lapses while Redis is away longer than the lease: the reaper must not take back the steps of
    workers that live, so it waits ``grace_s`` after it reaches the store again, and while Redis is younger."""
    store = MemoryJobStore()
    ledger = JobLedger(store, lease_s=0.1)
    taken = started(ledger, "ar@h#1.a")
    time.sleep(0.15)  # the lease lapsed "during the outage"
    uptime = [100.0]
    reaper = Reaper(ledger, store, owner="r", queues=list, interval_s=0.01, grace_s=0.5,
                    store_uptime_s=lambda: uptime[0])
    reaper.store_failed()  # a pass found the store away
    report = reaper.run_once()
    assert (report.deferred, report.requeued) == (1, 0)
    assert ledger.renew([taken.lease]) == []  # the worker lives: its keeper renews within the grace
    time.sleep(0.5)
    assert ledger.renew([taken.lease]) == []
    assert reaper.run_once().requeued == 0 and ledger.require(taken.job.id).stage_record("ar").attempts == 1
    time.sleep(0.25)  # its worker died after all: once the grace is over, the lease is taken back (a pass
    uptime[0] = 0.2  # holds the reaper's lock 0.2 s) ... but not while Redis itself has just started (a restart)
    assert reaper.run_once().deferred == 1
    uptime[0] = 100.0
    time.sleep(0.25)
    assert reaper.run_once().requeued == 1
    assert ledger.require(taken.job.id).stage_record("ar").status is StageStatus.queued


def test_the_watchdog_republishes_only_what_waits_on_an_empty_queue() -> None:
    store = MemoryJobStore()
    ledger = JobLedger(store)
    submitted = ledger.submit(job(), ["ar"])[0]
    Scheduler(store, None).release_all()
    store.ack_outbox([e.id for e in store.claim_outbox(now=now(), limit=10, hold_s=60)])  # published, then lost
    depth = {"ar": 3}
    reaper = Reaper(ledger, store, owner="r", queues=lambda: ["ar"], queue_depth=lambda q: depth[q],
                    dispatch_timeout_s=0.05, interval_s=0.01)
    time.sleep(0.1)
    assert reaper.run_once().redispatched == 0  # messages still wait in the broker: maybe a backlog
    depth["ar"] = 0
    time.sleep(0.25)  # the next pass (the pass lock lasts at least 0.2 s)
    assert reaper.run_once().redispatched == 1
    assert [e.step for e in store.claim_outbox(now=now(), limit=10, hold_s=1)] == [RunStage(submitted.id, "ar", 1, "ar")]


def test_behind_a_backlog_the_watchdog_waits_the_backlog_timeout() -> None:
    """The broker keeps no copy of a message a worker took (no ack emulation): a step whose message
    died with its worker while others still wait on the queue goes out again after backlog_timeout_s."""
    store = MemoryJobStore()
    ledger = JobLedger(store)
    submitted = ledger.submit(job(), ["ar"])[0]
    Scheduler(store, None).release_all()
    store.ack_outbox([e.id for e in store.claim_outbox(now=now(), limit=10, hold_s=60)])  # taken, then lost
    reaper = Reaper(ledger, store, owner="r", queues=lambda: ["ar"], queue_depth=lambda q: 5,
                    dispatch_timeout_s=0.05, backlog_timeout_s=0.5, interval_s=0.01)
    time.sleep(0.1)
    assert reaper.run_once().redispatched == 0  # a backlog: it may still be on its way
    time.sleep(0.5)
    report = reaper.run_once()
    assert report.redispatched == 1 and "behind a backlog" in report.details[0]
    assert [e.step for e in store.claim_outbox(now=now(), limit=10, hold_s=1)] == [RunStage(submitted.id, "ar", 1, "ar")]


def test_a_restarted_worker_takes_back_its_predecessors_steps_at_once() -> None:
    store = MemoryJobStore()
    ledger = JobLedger(store, lease_s=3600)  # the lease would hold for an hour
    old = started(ledger, "dit@host#100.aa")
    other = started(ledger, "ar@host#101.bb")
    reaper = Reaper(ledger, store, owner="r", queues=list)
    report = reaper.reclaim_node("dit@host", current_owner="dit@host#200.cc")
    assert report.requeued == 1
    assert ledger.require(old.job.id).stage_record("ar").status is StageStatus.queued
    assert ledger.require(other.job.id).status is JobStatus.running  # another node's step is left alone


def test_a_commit_that_ends_a_running_step_frees_its_place_and_wakes_the_relay() -> None:
    store = MemoryJobStore()
    ledger = JobLedger(store)
    woken: list[set[str]] = []
    ledger.outbox_listeners.append(lambda change: woken.append(set(change.freed)))
    submitted = ledger.submit(job(), ["ar"])[0]
    Scheduler(store, None).release_all()
    taken = ledger.acquire(RunStage(submitted.id, "ar", 1, "ar"), worker="w", owner="w#1")
    assert isinstance(taken, Acquired)
    woken.clear()
    assert ledger.fail(submitted.id, JobError(type="EngineError", message="boom"), lease=taken.lease)
    assert woken and woken[-1] == {"ar"}


def test_an_idle_relay_backs_off_and_still_wakes_when_a_delayed_entry_comes_due() -> None:
    """Empty passes double the wait (an idle process seldom wakes Redis); the pass says when the
    outbox's next entry comes due, and the relay is there for it, however long it had backed off."""
    store = MemoryJobStore()
    ledger = JobLedger(store)
    transport = Transport()
    scheduler = Scheduler(store, None)
    passes = counting_passes(scheduler)
    idle = OutboxRelay(store, transport.publish, poll_s=0.02, idle_poll_s=0.32, scheduler=scheduler).start()
    time.sleep(1.5)
    idle.stop()
    assert 4 <= passes["release"] <= 12  # at a fixed 0.02 s: ~75
    relay = OutboxRelay(store, transport.publish, poll_s=0.3, idle_poll_s=30.0, scheduler=Scheduler(store, None))
    ledger.outbox_listeners.append(relay.wake)
    submitted = ledger.submit(job(), ["ar"])[0]
    deadline = time.monotonic() + 2
    while not transport.published and time.monotonic() < deadline:
        time.sleep(0.005)
    taken = ledger.acquire(RunStage(submitted.id, "ar", 1, "ar"), worker="w", owner="w#1")
    assert isinstance(taken, Acquired)
    retried_at = time.monotonic()
    assert ledger.retry_later(taken.lease, JobError(type="TransientError", message="blip"), 1.0) == "retrying"
    while len(transport.published) < 2 and time.monotonic() < retried_at + 5:
        time.sleep(0.005)
    published_after = time.monotonic() - retried_at
    relay.stop()
    assert transport.published == [f"stage:{submitted.id}:ar:1", f"stage:{submitted.id}:ar:2"]
    assert 0.95 <= published_after < 1.3  # backed off to 0.6 s and more, it woke for the due time


def test_the_reaper_cancels_a_job_past_its_cancel_after_that_never_started() -> None:
    """Cancel-After of a job no worker took (its queue has none): every worker's reaper, whatever its
    queues, ends it within a pass, where only the hourly cleanup on the results queue did."""
    store = MemoryJobStore()
    ledger = JobLedger(store)
    waiting = job()
    waiting.deadline_at = waiting.created_at + 0.1
    later = job()
    later.deadline_at = later.created_at + 3600
    ledger.submit(waiting, ["ar"])
    ledger.submit(later, ["ar"])
    reaper = Reaper(ledger, store, owner="r", queues=lambda: ["dit"], interval_s=0.01)  # a worker of another queue
    assert reaper.run_once().canceled == 0
    time.sleep(0.25)  # past its deadline, and past the pass lock
    report = reaper.run_once()
    assert report.canceled == 1 and f"{waiting.id}: canceled (Cancel-After)" in report.details
    assert ledger.require(waiting.id).status is JobStatus.canceled
    assert ledger.require(later.id).status is JobStatus.queued
    assert store.overdue(now=now() + 1, limit=10) == []  # off the deadline index: no pass looks at it again
