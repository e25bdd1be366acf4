"""Batch filling: a starting batch with room left waits (bounded) for work known to be on its way,
and starts at once when nothing is coming, so a lone request's latency does not grow."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omni_jobs.engines.batching import Arrivals, Batcher, BatchPolicy, Member
from tests.unit.test_batching import CostRecorder, ran_twice


def square(batch: Sequence[Member[Any, Any]]) -> list[Any]:
    return [m.request * m.request for m in batch]


def test_a_lone_request_starts_at_once_when_nothing_is_coming():
    arrivals = Arrivals(fill_wait_ms=5_000)
    batcher: Batcher[int, int] = Batcher(square, BatchPolicy(max_batch_size=8, wait_ms=0), arrivals=arrivals)
    started = time.monotonic()
    with arrivals.task("t1"):
        assert batcher.submit(3) == 9
    assert time.monotonic() - started < 1.0
    assert batcher.batches == [1] and batcher.filled_s == []


def run_tasks(batcher: Batcher[int, int], arrivals: Arrivals, delays: list[float]) -> list[int]:
    """One task per delay, all received at once (as the consumer does), each submitting after its delay."""
    for i in range(len(delays)):
        arrivals.received(f"t{i}")

    def task(i: int) -> int:
        with arrivals.task(f"t{i}"):
            time.sleep(delays[i])  # the task's work before its engine call (Redis reads, inputs)
            return batcher.submit(i)

    with ThreadPoolExecutor(len(delays)) as pool:
        return list(pool.map(task, range(len(delays))))


def test_a_batch_waits_for_tasks_already_received_and_fills_up():
    arrivals = Arrivals(fill_wait_ms=5_000)
    batcher: Batcher[int, int] = Batcher(square, BatchPolicy(max_batch_size=4, wait_ms=0), arrivals=arrivals)
    started = time.monotonic()
    assert run_tasks(batcher, arrivals, [0.0, 0.1, 0.2, 0.3]) == [0, 1, 4, 9]
    assert batcher.batches == [4]  # without filling: [1, ...], the first request alone
    assert time.monotonic() - started < 3.0


def test_without_fill_wait_the_first_request_goes_alone():
    arrivals = Arrivals(fill_wait_ms=0)
    batcher: Batcher[int, int] = Batcher(square, BatchPolicy(max_batch_size=4, wait_ms=0), arrivals=arrivals)
    run_tasks(batcher, arrivals, [0.0, 0.3, 0.3, 0.3])
    assert batcher.batches[0] == 1


def test_the_fill_wait_is_bounded():
    arrivals = Arrivals(fill_wait_ms=100)
    batcher: Batcher[int, int] = Batcher(square, BatchPolicy(max_batch_size=4, wait_ms=0), arrivals=arrivals)
    run_tasks(batcher, arrivals, [0.0, 1.0])
    assert batcher.batches == [1, 1]
    assert 0.05 < batcher.filled_s[0] < 0.9


def test_a_task_that_ends_without_an_engine_call_stops_the_wait():
    arrivals = Arrivals(fill_wait_ms=10_000)
    batcher: Batcher[int, int] = Batcher(square, BatchPolicy(max_batch_size=4, wait_ms=0), arrivals=arrivals)
    arrivals.received("cache-hit")
    gone = threading.Event()

    def cache_hit() -> None:
        with arrivals.task("cache-hit"):
            time.sleep(0.2)  # ends without submitting (a stage-cache hit)
        gone.set()

    t = threading.Thread(target=cache_hit)
    t.start()
    started = time.monotonic()
    with arrivals.task("t0"):
        assert batcher.submit(2) == 4
    t.join()
    assert gone.is_set() and time.monotonic() - started < 3.0


def test_queued_messages_count_only_while_the_worker_has_free_slots():
    depth = [5]
    arrivals = Arrivals(fill_wait_ms=50, probe=lambda: depth[0], capacity=2)
    assert arrivals.expected() == 2  # no task yet: two free slots can take two of the five
    with arrivals.task("a"):
        assert arrivals.expected() == 1 + 1  # itself (not yet at a batcher) and one free slot
        with arrivals.task("b"):
            assert arrivals.expected() == 2  # both arriving, no free slot: the queue does not count
    depth[0] = 0
    assert arrivals.expected() == 0


def test_a_received_task_that_never_starts_expires():
    arrivals = Arrivals(fill_wait_ms=50, expire_s=0.05)
    arrivals.received("lost")
    assert arrivals.arriving() == 1
    time.sleep(0.1)
    assert arrivals.arriving() == 0


def dit_like(run: CostRecorder, arrivals: Arrivals) -> Batcher[int, int]:
    """A batcher whose running batch takes no newcomers (burst filling on), that ran batches of 1 and
    2, twice each: it knows its fixed cost per batch (a size's first run is cold, and not fitted). Its
    window (30 ms) holds the two requests made at once."""
    batcher: Batcher[int, int] = Batcher(run, BatchPolicy(max_batch_size=4, wait_ms=30, burst_fill=1.0),
                                         arrivals=arrivals)
    ran_twice(batcher)
    assert batcher.batches == [1, 2, 1, 2]
    return batcher


def test_a_linear_engines_batch_does_not_wait_for_tasks_on_their_way():
    """No fixed cost per batch (bench.batch_curve: the CPU DiTs): a task that comes later runs in the
    next batch at no cost, so the batch starts with what is there."""
    arrivals = Arrivals(fill_wait_ms=5_000)
    batcher = dit_like(CostRecorder(fixed_s=0.0, per_member_s=0.05), arrivals)
    assert run_tasks(batcher, arrivals, [0.0, 0.3, 0.3, 0.3]) == [0, 1, 4, 9]
    assert batcher.batches[4] == 1


def test_the_fill_wait_of_a_batch_with_a_fixed_cost_is_bounded_by_that_cost():
    """A task more than one fixed cost away is not waited for: running it in the next batch costs that much."""
    arrivals = Arrivals(fill_wait_ms=5_000)
    batcher = dit_like(CostRecorder(fixed_s=0.2, per_member_s=0.01), arrivals)
    assert run_tasks(batcher, arrivals, [0.0, 0.05, 0.1, 0.8]) == [0, 1, 4, 9]
    assert batcher.batches[4:] == [3, 1]
    assert 0.05 < max(batcher.filled_s) < 0.4  # waited for the two within reach, not for the third
