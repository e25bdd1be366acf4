"""The request batcher: concurrent callers share engine calls, and each gets its own result or error."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

import pytest

from omni_jobs.core import telemetry
from omni_jobs.engines import batching
from omni_jobs.engines.batching import (
    BatchDefaults,
    Batcher,
    BatchPolicy,
    Member,
    burst_wait_pays,
    fixed_cost_s,
    for_tenant,
)


class Recorder:
    """A stand-in batch function that records every call: squares numbers, refuses negatives as a batch."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls: list[list[Any]] = []
        self.delay_s = delay_s
        self.lock = threading.Lock()

    def __call__(self, batch: Sequence[Member[Any, Any]]) -> list[Any]:
        requests = [m.request for m in batch]
        with self.lock:
            self.calls.append(requests)
        time.sleep(self.delay_s)
        if any(isinstance(r, int) and r < 0 for r in requests):
            raise ValueError(f"negative request in {requests}")
        return [KeyError(r) if r == "bad" else (r * r if isinstance(r, int) else r.upper()) for r in requests]


def submit_all(batcher: Batcher[Any, Any], requests: list[Any]) -> list[Any]:
    """Submit every request from its own thread at once; each slot holds a result or the raised error."""
    start = threading.Barrier(len(requests))

    def one(r: Any) -> Any:
        start.wait()
        try:
            return batcher.submit(r)
        except Exception as exc:  # noqa: BLE001 - the slot holds what that caller raised
            return exc

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def test_concurrent_requests_share_one_call_and_each_gets_its_own_result():
    run = Recorder()
    batcher: Batcher[int, int] = Batcher(run, BatchPolicy(max_batch_size=8, wait_ms=200))
    results = submit_all(batcher, list(range(8)))
    assert results == [i * i for i in range(8)]
    assert len(run.calls) == 1 and sorted(run.calls[0]) == list(range(8))
    assert batcher.batches == [8]


def test_each_batch_reports_how_long_its_first_request_waited_and_how_long_it_ran():
    """What omni_jobs_engine_batch_wait_seconds and _run_seconds count: the first request waits out
    the 150 ms window (the batch never fills), the second batch's first waits for the first batch."""
    seen: list[tuple[str, float, float]] = []

    class Timings(telemetry.Listener):
        def batch_ran(self, batcher: str, waited_s: float, run_s: float) -> None:
            seen.append((batcher, waited_s, run_s))

    class Running(Recorder):
        def __init__(self) -> None:
            super().__init__(delay_s=0.2)
            self.running = threading.Event()

        def __call__(self, batch: Sequence[Member[Any, Any]]) -> list[Any]:
            self.running.set()
            return super().__call__(batch)

    listener = Timings()
    telemetry.add_listener(listener)
    run = Running()
    try:
        batcher: Batcher[int, int] = Batcher(run, BatchPolicy(max_batch_size=2, wait_ms=150), name="dit")
        first = threading.Thread(target=batcher.submit, args=(1,))
        started = time.monotonic()
        first.start()
        assert run.running.wait(10)  # the first batch (of 1) is running
        running = time.monotonic()
        assert batcher.submit(2) == 4
        first.join()
        ended = time.monotonic()
    finally:
        telemetry.remove_listener(listener)
    (name1, wait1, run1), (name2, wait2, run2) = seen
    assert name1 == name2 == "dit" and run.calls == [[1], [2]]
    # bounded below by the window and the run's sleep, above by what this thread saw (not by a time window)
    assert 0.14 <= wait1 <= running - started and 0.19 <= run1
    assert 0.14 <= wait2 and 0.19 <= run2  # at least its own window (the first batch's rest counts in it)
    assert wait1 + run1 + run2 <= ended - started and wait2 + run2 <= ended - running


def test_a_full_batch_does_not_wait_for_the_window():
    batcher: Batcher[int, int] = Batcher(Recorder(), BatchPolicy(max_batch_size=4, wait_ms=10_000))
    started = time.monotonic()
    assert submit_all(batcher, [1, 2, 3, 4]) == [1, 4, 9, 16]
    assert time.monotonic() - started < 5


def test_batches_never_exceed_the_max_size():
    run = Recorder(delay_s=0.01)
    batcher: Batcher[int, int] = Batcher(run, BatchPolicy(max_batch_size=3, wait_ms=50))
    assert submit_all(batcher, list(range(10))) == [i * i for i in range(10)]
    assert max(len(c) for c in run.calls) <= 3
    assert sorted(r for c in run.calls for r in c) == list(range(10))


def test_incompatible_requests_go_to_separate_calls():
    run = Recorder()
    batcher: Batcher[Any, Any] = Batcher(run, BatchPolicy(max_batch_size=8, wait_ms=200), group_key=type)
    results = submit_all(batcher, [1, "a", 2, "b"])
    assert results == [1, "A", 4, "B"]
    assert sorted(sorted(map(str, c)) for c in run.calls) == [["1", "2"], ["a", "b"]]


def test_a_member_error_goes_to_that_member_only():
    run = Recorder()
    batcher: Batcher[Any, Any] = Batcher(run, BatchPolicy(max_batch_size=4, wait_ms=200))
    results = submit_all(batcher, ["x", "bad", "y", "z"])
    assert results[0] == "X" and results[2:] == ["Y", "Z"]
    assert isinstance(results[1], KeyError)
    assert len(run.calls) == 1


def test_a_failing_batch_is_retried_singly_so_only_the_bad_request_fails():
    run = Recorder()
    batcher: Batcher[int, int] = Batcher(run, BatchPolicy(max_batch_size=4, wait_ms=200))
    results = submit_all(batcher, [2, -1, 3, 4])
    assert [results[0], results[2], results[3]] == [4, 9, 16]
    assert isinstance(results[1], ValueError) and "-1" in str(results[1])
    assert len(run.calls[0]) == 4 and all(len(c) == 1 for c in run.calls[1:]) and len(run.calls) == 5


def test_requests_arriving_during_a_batch_form_the_next_one():
    gate = Gate()
    batcher: Batcher[Any, Any] = Batcher(gate, BatchPolicy(max_batch_size=16, wait_ms=0))
    # "h" runs, held; 2, 3, 4 come while it does
    assert held_then_released(batcher, gate, [(None, 2), (None, 3), (None, 4)]) == ["H", 4, 9, 16]
    assert gate.calls == [["h"], [2, 3, 4]]


def test_the_group_of_the_lowest_ranked_waiting_request_runs_next():
    """A code2wav stream's first window (rank 0) goes before windows that came earlier (rank 1)."""
    gate = Gate()
    batcher: Batcher[Any, Any] = Batcher(gate, BatchPolicy(max_batch_size=16, wait_ms=0), group_key=type,
                                         rank=lambda r: 0 if isinstance(r, str) else 1)
    # "h" runs, held; 2, 3, then "a" wait for it, in that order
    assert held_then_released(batcher, gate, [(None, 2), (None, 3), (None, "a")]) == ["H", 4, 9, "A"]
    assert gate.calls == [["h"], ["a"], [2, 3]]


class Gate(Recorder):
    """A batch function whose first call holds its batch until ``open`` (the batch a worker is running)."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = threading.Event()
        self.holding = threading.Event()

    def __call__(self, batch: Sequence[Member[Any, Any]]) -> list[Any]:
        if not self.holding.is_set():
            self.holding.set()
            self.opened.wait(10)
        return super().__call__(batch)


def held_then_released(batcher: Batcher[Any, Any], gate: Gate, waiting: list[tuple[str | None, Any]],
                       held_by: str = "a") -> list[Any]:
    """One request of ``held_by`` runs (held at the gate) while ``waiting`` (tenant, request) come in order
    and wait behind it; then the gate opens. Returns every request's result, the held one first."""
    def submit(tenant: str | None, request: Any) -> Any:
        with for_tenant(tenant):
            return batcher.submit(request)

    with ThreadPoolExecutor(len(waiting) + 1) as pool:
        held = pool.submit(submit, held_by, "h")
        assert gate.holding.wait(10)
        futures = []
        for n, (tenant, request) in enumerate(waiting):
            futures.append(pool.submit(submit, tenant, request))
            while True:  # each in its place before the next: arrival order is the test's
                with batcher._cond:
                    if len(batcher._pending) == n + 1:
                        break
                time.sleep(0.001)
        gate.opened.set()
        return [held.result(), *[f.result() for f in futures]]


def test_a_batch_takes_waiting_tenants_in_turn_the_one_served_longest_ago_first():
    """A's backlog came while A's batch ran, B's two after it: the next batch of 4 takes B's first (never
    served), then turns (b0 a0 b1 a1); A's rest go next, in arrival order."""
    gate = Gate()
    batcher: Batcher[str, str] = Batcher(gate, BatchPolicy(max_batch_size=4, wait_ms=0))
    waiting = [("a", f"a{i}") for i in range(5)] + [("b", "b0"), ("b", "b1")]
    assert held_then_released(batcher, gate, waiting) == ["H", "A0", "A1", "A2", "A3", "A4", "B0", "B1"]
    assert gate.calls == [["h"], ["b0", "a0", "b1", "a1"], ["a2", "a3", "a4"]]


def test_turns_last_from_batch_to_batch():
    """A tenant just served waits for the others: C (never served) first, then B (served longest ago),
    then A, whose turn was the latest."""
    gate = Gate()
    batcher: Batcher[str, str] = Batcher(gate, BatchPolicy(max_batch_size=8, wait_ms=0))
    batcher._served, batcher._turns = {"b": 100, "a": 101}, itertools.count(102)  # B's turn, then A's
    waiting = [("a", "a0"), ("a", "a1"), ("b", "b0"), ("c", "c0"), ("b", "b1")]
    held_then_released(batcher, gate, waiting, held_by="z")
    assert gate.calls[1] == ["c0", "b0", "a0", "b1", "a1"]


def test_one_tenants_requests_keep_their_order_and_fill_the_batch():
    gate = Gate()
    batcher: Batcher[str, str] = Batcher(gate, BatchPolicy(max_batch_size=4, wait_ms=0))
    held_then_released(batcher, gate, [("a", f"a{i}") for i in range(6)])
    assert gate.calls == [["h"], ["a0", "a1", "a2", "a3"], ["a4", "a5"]]


def test_the_next_group_is_that_of_the_tenant_served_longest_ago():
    """Requests of different call settings do not share a batch: B's group runs before A's earlier one."""
    gate = Gate()
    batcher: Batcher[str, str] = Batcher(gate, BatchPolicy(max_batch_size=8, wait_ms=0), group_key=lambda r: r[0])
    held_then_released(batcher, gate, [("a", "a0"), ("a", "a1"), ("b", "b0")])
    assert gate.calls[1:] == [["b0"], ["a0", "a1"]]


def submit_paced(batcher: Batcher[Any, Any], requests: list[Any], gap_s: float) -> list[Any]:
    """Submit each request from its own thread, ``gap_s`` apart (a client's burst reaching a worker): the
    n-th at n gaps after the first, so that a late wake-up on a loaded machine delays one, not all after it."""
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = []
        first = time.monotonic()
        for n, r in enumerate(requests):
            time.sleep(max(0.0, first + n * gap_s - time.monotonic()))
            futures.append(pool.submit(batcher.submit, r))
        return [f.result() for f in futures]


class CostRecorder(Recorder):
    """A batch function whose run time is a fixed part plus a part per member, as a DiT call's."""

    def __init__(self, fixed_s: float, per_member_s: float) -> None:
        super().__init__()
        self.fixed_s, self.per_member_s = fixed_s, per_member_s

    def __call__(self, batch: Sequence[Member[Any, Any]]) -> list[Any]:
        self.delay_s = self.fixed_s + self.per_member_s * len(batch)
        return super().__call__(batch)


def burst_batcher(run: CostRecorder, burst_fill: float = 1.0, wait_ms: float = 30) -> Batcher[int, int]:
    """A DiT-like batcher (no newcomers once a batch runs) that ran batches of 1 and 2, twice each (so it
    knows its fixed cost: a size's first run is not fitted); a batch's first request waits ``wait_ms``
    for company (a worker's wait 10-20 ms)."""
    batcher: Batcher[int, int] = Batcher(run, BatchPolicy(max_batch_size=8, wait_ms=wait_ms, burst_fill=burst_fill))
    ran_twice(batcher)
    assert run.calls == [[0], [0, 0], [0], [0, 0]]
    del run.calls[:]
    return batcher


@pytest.fixture
def burst_looks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Each look a batch's burst wait takes (``burst_wait_pays``): how many of its group had arrived, and
    whether waiting on still paid. A wait that ends at a look that says no ended because the burst did,
    not at its deadline: what a test asserts instead of how long the wait took."""
    looks: list[tuple[int, bool]] = []

    def pays(arrived: Sequence[float], now: float, fixed_s: float) -> bool:
        verdict = burst_wait_pays(arrived, now, fixed_s)
        looks.append((len(arrived), verdict))
        return verdict

    monkeypatch.setattr(batching, "burst_wait_pays", pays)
    return looks


def ran_twice(batcher: Batcher[int, int]) -> None:
    """Batches of 1 and of 2, twice each: the second run of each size is a warm one."""
    for _ in range(2):
        assert batcher.submit(0) == 0 and submit_all(batcher, [0, 0]) == [0, 0]


def test_a_batch_is_recorded_before_its_callers_go_on():
    """A caller back from ``submit`` finds its batch counted (the telemetry listeners, the batcher's
    record): the members were woken after it, so a slow listener cannot leave them a step ahead."""
    seen: list[float] = []

    class SlowListener(telemetry.Listener):
        def batch_ran(self, batcher: str, waited_s: float, run_s: float) -> None:
            time.sleep(0.05)
            seen.append(run_s)

    listener = SlowListener()
    telemetry.add_listener(listener)
    try:
        batcher: Batcher[int, int] = Batcher(Recorder(delay_s=0.01), BatchPolicy(max_batch_size=4, wait_ms=0))
        assert batcher.submit(3) == 9
        assert len(seen) == 1 and batcher.batches == [1]
        assert submit_all(batcher, [1, 2]) == [1, 4]
        assert len(seen) == 1 + len(batcher.batches[1:])
    finally:
        telemetry.remove_listener(listener)


def test_the_fixed_cost_of_a_batch_is_fitted_from_its_sizes_and_times():
    assert fixed_cost_s([]) is None and fixed_cost_s([(32, 2.6), (32, 2.7)]) is None  # one size: unknown
    # the DiT 32px small engine on this machine: 8, 16, 24, 32 images in 0.94, 1.62, 2.21, 2.63 s
    assert fixed_cost_s([(8, 0.94), (16, 1.62), (24, 2.21), (32, 2.63)]) == pytest.approx(0.43, abs=0.01)
    assert fixed_cost_s([(1, 0.4), (2, 0.4)]) == pytest.approx(0.4)  # all fixed: capped at the shortest run
    assert fixed_cost_s([(1, 0.1), (2, 0.3)]) == 0.0  # more than linear: nothing to amortise
    # a worker's runs: a cold first batch of 32 (2.9 s) among warm ones; the least time per size is fitted
    warm = [(12, 0.69), (32, 1.76), (20, 1.12), (12, 0.69), (32, 1.46), (20, 1.05)]
    assert fixed_cost_s([(32, 2.9), *warm]) == pytest.approx(fixed_cost_s([(12, 0.69), (20, 1.05), (32, 1.46)]))
    assert fixed_cost_s([(32, 2.9), *warm]) == pytest.approx(0.25, abs=0.01)  # over all runs: 0


def test_a_burst_is_waited_for_while_each_newcomer_pays_for_its_wait():
    assert not burst_wait_pays([0.0], 0.001, fixed_s=0.4)  # a lone request: no pace to go by
    assert burst_wait_pays([0.0, 0.01, 0.02], 0.025, fixed_s=0.4)  # 3 x 10 ms < 0.4 s
    assert not burst_wait_pays([0.0, 0.01, 0.02], 0.075, fixed_s=0.4)  # quiet for 5.5 gaps (> 50 ms): over
    assert burst_wait_pays([0.0, 0.01, 0.02], 0.065, fixed_s=0.4)  # 4.5 gaps, but within an eighth of 0.4 s
    assert burst_wait_pays([0.0, 0.001], 0.009, fixed_s=0.04)  # quiet 8 ms: within the 10 ms floor
    assert not burst_wait_pays([0.0, 0.001], 0.012, fixed_s=0.04)
    assert not burst_wait_pays([0.0, 0.15, 0.30], 0.31, fixed_s=0.4)  # 3 x 150 ms > 0.4 s: too slow to pay


def test_a_batch_waits_for_a_burst_that_pays_for_the_wait(burst_looks):
    run = CostRecorder(fixed_s=0.3, per_member_s=0.01)
    # the window (60 ms) holds 3-4 of the burst's 8 requests; it is long enough that a loaded machine's
    # late thread start does not leave the first request alone in it (that leaves no pace to go by)
    batcher = burst_batcher(run, wait_ms=60)
    del burst_looks[:]
    started = time.monotonic()
    assert submit_paced(batcher, list(range(1, 9)), gap_s=0.02) == [i * i for i in range(1, 9)]
    took = time.monotonic() - started
    assert run.calls == [list(range(1, 9))]  # one full batch, not what came within the window
    # it waited past its window because each look said the burst paid, until the 8th filled the batch
    assert burst_looks and all(pays for _, pays in burst_looks), burst_looks
    assert 0 < batcher.filled_s[-1] < took  # the wait past the window is counted, and it is this burst's


def test_a_bursts_bound_is_a_fraction_of_the_longest_recent_run_and_at_most_the_fixed_cost():
    assert batching.burst_bound_s([(8, 0.7), (1, 0.35)], fixed_s=0.3, burst_fill=0.4) == pytest.approx(0.28)
    assert batching.burst_bound_s([(1, 0.35), (8, 0.7)], fixed_s=0.3, burst_fill=0.4) == pytest.approx(0.28)
    assert batching.burst_bound_s([(8, 0.7)], fixed_s=0.1, burst_fill=0.4) == pytest.approx(0.1)


def test_the_wait_is_bounded_by_the_longest_recent_run_not_the_last(monkeypatch: pytest.MonkeyPatch):
    """A straggler's batch of one ran last: the batcher bounds the next burst's wait by the runs it recorded,
    the full batch's among them (what it decided is asserted, not how long the batch took to start)."""
    bounds: list[tuple[list[tuple[int, float]], float]] = []
    burst_bound_s = batching.burst_bound_s

    def bound(runs: Sequence[tuple[int, float]], fixed_s: float, burst_fill: float) -> float:
        bounds.append((list(runs), burst_bound_s(runs, fixed_s, burst_fill)))
        return bounds[-1][1]

    monkeypatch.setattr(batching, "burst_bound_s", bound)
    run = CostRecorder(fixed_s=0.3, per_member_s=0.05)
    batcher = burst_batcher(run, burst_fill=0.4, wait_ms=60)  # ran 1 and 2: a = 0.3 s
    for _ in range(2):  # the second is warm: a size's first run is not remembered
        assert submit_all(batcher, list(range(8))) == [i * i for i in range(8)]  # 0.7 s
    assert batcher.submit(2) == 4  # the last run: 0.35 s
    del bounds[:]
    assert submit_all(batcher, list(range(1, 8))) == [i * i for i in range(1, 8)]  # room left: a bound is set
    runs, chosen = bounds[0]
    assert [n for n, _ in runs][-1] == 1  # the batch of one ran last
    full = max(t for n, t in runs if n == 8)
    assert full >= 0.7 and chosen == pytest.approx(min(0.3, 0.4 * full))  # 0.28 s, not 0.4 x the last 0.35 s


def test_without_burst_filling_the_burst_splits():
    run = CostRecorder(fixed_s=0.3, per_member_s=0.01)
    batcher = burst_batcher(run, burst_fill=0.0, wait_ms=60)
    submit_paced(batcher, list(range(1, 9)), gap_s=0.02)
    assert len(run.calls[0]) < 8 and len(run.calls) > 1  # what came within the window, then the rest


def test_a_batch_of_a_linear_engine_does_not_wait_for_a_burst():
    """No fixed cost per batch (a compute-bound DiT on the CPU: bench.batch_curve): a part batch costs
    the engine nothing, so the batch starts after its window and the rest of the burst runs next."""
    run = CostRecorder(fixed_s=0.0, per_member_s=0.02)
    batcher = burst_batcher(run, wait_ms=60)  # ran 1 and 2 in 20 and 40 ms: a = 0
    assert submit_paced(batcher, list(range(1, 9)), gap_s=0.02) == [i * i for i in range(1, 9)]
    assert len(run.calls[0]) < 8 and sorted(x for call in run.calls for x in call) == list(range(1, 9))


def test_a_lone_request_and_a_finished_burst_do_not_wait(burst_looks):
    """Each batch's burst wait ends at a look that says no (the burst is over), not at its deadline (0.3 s
    after its first request, the fixed cost): the looks are asserted, not the time the batches took."""
    run = CostRecorder(fixed_s=0.3, per_member_s=0.01)
    batcher = burst_batcher(run)
    del burst_looks[:]
    assert batcher.submit(3) == 9
    assert burst_looks == [(1, False)]  # alone: no pace to go by, so it starts at its first look
    del burst_looks[:]
    assert submit_paced(batcher, [1, 2, 3], gap_s=0.002) == [1, 4, 9]
    assert run.calls == [[3], [1, 2, 3]]
    assert burst_looks[-1] == (3, False), burst_looks  # the burst ended after 3: it started once they stopped


class HeldTurn:
    """An engine's turn that another worker's step holds until ``give``; ``asked`` is set once a batch
    formed and waits for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.asked = threading.Event()

    def give(self) -> None:
        self.lock.release()

    def __enter__(self) -> Self:
        self.asked.set()
        self.lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def outcomes(members: list[Member[int, int]]) -> list[int | None]:
    assert all(m.done.wait(10) for m in members)
    return [m.result for m in members]


def test_a_batch_waiting_for_its_engines_turn_takes_in_what_came_meanwhile():
    """Another worker's engine step holds the turn: the requests that came while the batch waited for
    it run in that batch, not in the next one."""
    turn = HeldTurn()
    run = Recorder()
    batcher: Batcher[int, int] = Batcher(run, BatchPolicy(max_batch_size=8, wait_ms=0), turn=lambda: turn)
    first = [batcher.put(i) for i in (1, 2, 3)]
    assert turn.asked.wait(10)  # the batch (of 1 or more of 1-3) formed and waits for the turn
    later = [batcher.put(i) for i in (4, 5, 6)]
    turn.give()
    assert outcomes(first + later) == [1, 4, 9, 16, 25, 36]
    assert [sorted(c) for c in run.calls] == [[1, 2, 3, 4, 5, 6]] and batcher.batches == [6]


def test_a_full_batch_takes_no_more_when_its_turn_comes():
    turn = HeldTurn()
    run = Recorder()
    batcher: Batcher[int, int] = Batcher(run, BatchPolicy(max_batch_size=2, wait_ms=0), turn=lambda: turn)
    members = [batcher.put(i) for i in (1, 2)]
    assert turn.asked.wait(10)
    members += [batcher.put(i) for i in (3, 4)]
    turn.give()
    assert outcomes(members) == [1, 4, 9, 16]
    assert [sorted(c) for c in run.calls] == [[1, 2], [3, 4]]


def test_an_ar_batcher_never_waits_for_a_burst():
    from omni_jobs.engines.batching import ar_batcher

    class Engine:  # only what ar_batcher reads: the batcher it makes is inspected, not run
        pass

    batcher = ar_batcher(Engine(), BatchPolicy(burst_fill=0.5))  # type: ignore[arg-type]
    assert batcher.policy.burst_fill == 0.0  # a running vLLM batch takes newcomers between steps


def test_an_idle_batchers_thread_hands_back_its_openmp_team_once_until_it_runs_again():
    """The release happens on the thread that ran the engine calls (a team is that thread's), only
    after ``idle_release_s`` without work, and once per idle spell."""
    ran_on: list[int] = []
    released_on: list[int] = []

    def run(batch: Sequence[Member[int, int]]) -> list[int]:
        ran_on.append(threading.get_ident())
        return [m.request * 2 for m in batch]

    def release() -> None:
        released_on.append(threading.get_ident())

    batcher: Batcher[int, int] = Batcher(run, BatchPolicy(max_batch_size=4, wait_ms=0, idle_release_s=0.5),
                                         release_team=release)
    assert [batcher.submit(i) for i in (1, 2, 3)] == [2, 4, 6]  # one after another: no idle spell
    assert released_on == []
    deadline = time.monotonic() + 5
    while not released_on and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.7)  # more idle time does not release again
    assert released_on == [ran_on[0]] and batcher.released == 1
    assert batcher.submit(5) == 10  # the same thread serves on (its next op makes a new team)
    assert ran_on[-1] == ran_on[0]
    deadline = time.monotonic() + 5
    while len(released_on) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert released_on == [ran_on[0], ran_on[0]]


def test_wakes_without_work_do_not_postpone_the_release():
    """Arrivals wake the batchers (a task that ended without an engine call); the idle spell still
    counts from the last batch."""
    released: list[float] = []
    batcher: Batcher[int, int] = Batcher(lambda batch: [m.request for m in batch],
                                         BatchPolicy(wait_ms=0, idle_release_s=0.3), release_team=lambda: released.append(time.monotonic()))
    assert batcher.submit(1) == 1
    done = time.monotonic()
    while time.monotonic() - done < 1.0:  # a timer restarted by each wake would not end before these do
        batcher.wake()
        time.sleep(0.05)
    assert len(released) == 1 and released[0] - done < 0.9


def test_idle_release_zero_keeps_the_team():
    released: list[int] = []
    batcher: Batcher[int, int] = Batcher(lambda batch: [m.request for m in batch],
                                         BatchPolicy(wait_ms=0, idle_release_s=0), release_team=lambda: released.append(1))
    assert batcher.submit(7) == 7
    time.sleep(0.3)
    assert released == [] and batcher.released == 0


def test_policy_and_defaults_validate_and_resolve():
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchPolicy(max_batch_size=0)
    with pytest.raises(ValueError, match="wait_ms"):
        BatchPolicy(wait_ms=-1)
    with pytest.raises(ValueError, match="idle_release_s"):
        BatchPolicy(idle_release_s=-1)
    with pytest.raises(ValueError, match="burst_fill"):
        BatchPolicy(burst_fill=1.5)
    from omni_jobs.pipelines.spec import StageSpec

    stage = StageSpec.model_validate({"id": "ar", "engine": "ar", "model": "tiny:llama",
                                      "inputs": {"prompt": "input.prompt"},
                                      "batching": {"max_batch_size": 4, "wait_ms": 0}})
    defaults = BatchDefaults(max_batch_size=32, wait_ms=7, max_in_flight=9, idle_release_s=2.5, burst_fill=0.3)
    assert defaults.policy(stage) == BatchPolicy(max_batch_size=4, wait_ms=0, idle_release_s=2.5, burst_fill=0.3)
    assert defaults.in_flight(stage) == 9
    plain = stage.model_copy(update={"batching": type(stage.batching)()})
    assert defaults.policy(plain) == BatchPolicy(max_batch_size=32, wait_ms=7, idle_release_s=2.5, burst_fill=0.3)


def test_before_its_fixed_cost_is_known_a_batch_starts_after_its_window():
    """A fresh worker's batches were all one size (its warm-up, or full ones): no fit, so the next
    burst's batch starts with what came within its window, and its size is a second one to fit."""
    run = CostRecorder(fixed_s=0.3, per_member_s=0.01)
    batcher: Batcher[int, int] = Batcher(run, BatchPolicy(max_batch_size=8, wait_ms=60, burst_fill=1.0))
    for _ in range(2):
        assert submit_all(batcher, [0] * 8) == [0] * 8  # one size seen, warm: fixed_cost_s is None
    assert submit_paced(batcher, list(range(1, 9)), gap_s=0.02) == [i * i for i in range(1, 9)]
    assert 1 <= len(run.calls[2]) < 8


def test_a_sizes_first_run_is_not_fitted():
    """The first call at a batch size is cold (a CPU worker's allocations for new shapes: 6.2 s for a
    batch a warm call runs in 1.5): only a size's later runs count towards the fixed cost."""
    run = CostRecorder(fixed_s=0.3, per_member_s=0.01)
    batcher: Batcher[int, int] = Batcher(run, BatchPolicy(max_batch_size=8, wait_ms=60, burst_fill=1.0))
    assert batcher.submit(0) == 0 and submit_all(batcher, [0, 0]) == [0, 0]  # 1 and 2, once each: cold
    assert submit_paced(batcher, list(range(1, 9)), gap_s=0.02) == [i * i for i in range(1, 9)]
    assert len(run.calls[2]) < 8  # no fit: the burst was not waited for
    ran_twice(batcher)  # now 1 and 2 have warm runs: a = 0.3 s
    del run.calls[:]
    assert submit_paced(batcher, list(range(1, 9)), gap_s=0.02) == [i * i for i in range(1, 9)]
    assert run.calls == [list(range(1, 9))]


def test_the_first_batch_of_a_group_does_not_wait_for_a_burst():
    run = CostRecorder(fixed_s=0.3, per_member_s=0.01)
    batcher: Batcher[int, int] = Batcher(run, BatchPolicy(max_batch_size=8, wait_ms=60, burst_fill=1.0))
    submit_paced(batcher, list(range(1, 9)), gap_s=0.02)
    assert len(run.calls[0]) < 8  # nothing known of its cost: what came within the window
