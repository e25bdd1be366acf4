"""Group commit (omni_jobs.jobs.group_commit): calls that come while one is on its way go out
together next, each with its own answer; a lone call goes out at once, alone."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from omni_jobs.jobs.group_commit import GroupCommit
from tests.waiting import wait_until


class Wire:
    """A stand-in round trip that can be held open, recording what each one carried."""

    def __init__(self) -> None:
        self.sent: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next: BaseException | None = None

    def one(self, arg: int) -> int:
        return self.many([arg])[0]  # type: ignore[return-value]

    def many(self, args: Sequence[int]) -> list[int | BaseException]:
        self.sent.append(list(args))
        self.gate.wait(10)
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        return [ValueError(f"refused {a}") if a < 0 else a * 10 for a in args]


def burst(group: GroupCommit[int, int], args: Sequence[int]) -> tuple[list[threading.Thread], dict[int, object]]:
    answers: dict[int, object] = {}

    def run(arg: int) -> None:
        try:
            answers[arg] = group.call(arg)
        except (ValueError, ConnectionError) as exc:  # each caller's own outcome, reply or error
            answers[arg] = exc

    threads = [threading.Thread(target=run, args=(a,)) for a in args]
    for t in threads:
        t.start()
    return threads, answers


def test_a_lone_call_goes_out_at_once_alone() -> None:
    wire = Wire()
    group: GroupCommit[int, int] = GroupCommit(wire.one, wire.many)
    assert group.call(3) == 30
    assert group.call(4) == 40
    assert wire.sent == [[3], [4]] and group.round_trips == 2


def test_calls_made_while_one_is_out_go_together_next_each_with_its_own_answer() -> None:
    wire = Wire()
    group: GroupCommit[int, int] = GroupCommit(wire.one, wire.many)
    wire.gate.clear()  # the first round trip stays out
    first, first_answer = burst(group, [1])
    wait_until(lambda: wire.sent == [[1]], what="the first call is out")
    rest, answers = burst(group, [2, 3, -4, 5])
    wait_until(lambda: len(group._waiting) == 4, what="the others wait")
    wire.gate.set()
    for t in first + rest:
        t.join(10)
    assert wire.sent[0] == [1] and sorted(wire.sent[1]) == [-4, 2, 3, 5] and group.round_trips == 2
    assert first_answer == {1: 10}
    assert {k: v for k, v in answers.items() if k > 0} == {2: 20, 3: 30, 5: 50}
    assert isinstance(answers[-4], ValueError) and str(answers[-4]) == "refused -4"  # its own error, alone


def test_a_failed_round_trip_fails_every_call_of_it_and_the_next_goes_out() -> None:
    wire = Wire()
    group: GroupCommit[int, int] = GroupCommit(wire.one, wire.many)
    wire.gate.clear()
    first, first_answer = burst(group, [1])
    wait_until(lambda: wire.sent == [[1]], what="the first call is out")
    rest, answers = burst(group, [2, 3])
    wait_until(lambda: len(group._waiting) == 2, what="the others wait")
    wire.fail_next = ConnectionError("gone")  # the first round trip fails: only its call
    wire.gate.set()
    for t in first + rest:
        t.join(10)
    assert isinstance(first_answer[1], ConnectionError)
    assert answers == {2: 20, 3: 30}  # the next sender took over
    assert group.call(6) == 60 and not group._sending


def test_leading_passes_on_while_calls_keep_coming() -> None:
    wire = Wire()
    group: GroupCommit[int, int] = GroupCommit(wire.one, wire.many)
    wire.gate.clear()
    threads, answers = burst(group, [1])
    wait_until(lambda: len(wire.sent) == 1, what="round trip 1 is out")
    more, more_answers = burst(group, [2, 3])
    wait_until(lambda: len(group._waiting) == 2, what="two wait")
    wire.gate.set()  # round trip 1 back: its caller hands the sending to the first of the two
    last, last_answers = burst(group, [7, 8, 9])  # these come while round trip 2 may be out
    for t in threads + more + last:
        t.join(10)
    assert {**answers, **more_answers, **last_answers} == {1: 10, 2: 20, 3: 30, 7: 70, 8: 80, 9: 90}
    assert sorted(a for sent in wire.sent for a in sent) == [1, 2, 3, 7, 8, 9]  # each sent once
    assert group.round_trips == len(wire.sent) <= 6 and not group._sending


def test_a_burst_from_many_threads_takes_two_round_trips() -> None:
    callers = 32  # a DiT batch's completions
    wire = Wire()
    group: GroupCommit[int, int] = GroupCommit(wire.one, wire.many)
    wire.gate.clear()
    threads, answers = burst(group, list(range(1, callers + 1)))
    wait_until(lambda: len(group._waiting) == callers - 1, what="all but the first wait")
    wire.gate.set()
    for t in threads:
        t.join(10)
    assert answers == {a: a * 10 for a in range(1, callers + 1)}
    assert group.round_trips == 2  # the first alone, then the 31 that came meanwhile together
