"""FollowedJobs: which running jobs a reader looks at, asked for all of them at once, off the engine's thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from omni_jobs.jobs.followed import FollowedJobs, Readers
from tests.waiting import wait_until


def test_without_a_store_every_job_counts_as_followed() -> None:
    followed = FollowedJobs(None)
    followed.track("job_a")
    assert followed.watched("job_a") and followed.watched("job_b")
    assert followed.followed_among(["job_a", "job_b"]) == {"job_a", "job_b"}


def test_one_ask_covers_every_tracked_job_and_a_poll_is_not_a_stream() -> None:
    asked: list[list[str]] = []

    def ask(job_ids: Sequence[str]) -> Readers:
        asked.append(list(job_ids))
        return Readers(followed={"job_b"} & set(job_ids), looked_at={"job_a"} & set(job_ids))

    followed = FollowedJobs(ask, check_s=3600)  # its thread asks once when the first job comes, then sleeps
    followed.track("job_a")
    followed.track("job_b")
    followed.track("job_b")  # two stages of one job
    followed.untrack("job_b")
    followed.refresh()
    assert asked[-1] == ["job_a", "job_b"]
    assert followed.watched("job_a") and followed.watched("job_b") and not followed.watched("job_c")
    assert followed.followed_among(["job_a", "job_b", "job_c"]) == {"job_b"}  # text deltas: streams only
    followed.untrack("job_b")
    followed.refresh()
    assert asked[-1] == ["job_a"] and not followed.watched("job_b")


def test_the_thread_asks_every_check_and_a_failed_ask_keeps_the_last_answer() -> None:
    answers: list[Readers | Exception] = [Readers({"job_a"}, set()), RuntimeError("store down"), Readers(set(), set())]
    calls: list[float] = []
    third = threading.Event()

    def ask(job_ids: Sequence[str]) -> Readers:
        calls.append(time.monotonic())
        if len(calls) >= 3:
            third.wait(10)  # held until the test has looked at what the failed ask left
        answer = answers[min(len(calls) - 1, len(answers) - 1)]
        if isinstance(answer, Exception):
            raise answer
        return answer

    followed = FollowedJobs(ask, check_s=0.05)
    followed.track("job_a")
    wait_until(lambda: len(calls) >= 3, what="a third ask")  # the second one failed before it
    assert followed.watched("job_a")  # the first answer, kept through the failed second ask
    third.set()
    wait_until(lambda: not followed.watched("job_a"), what="the third answer (nobody reads job_a)")
    assert calls[1] - calls[0] >= 0.04  # at most one ask per check


def test_a_job_that_starts_is_asked_about_at_once_not_at_the_next_check() -> None:
    asked: list[tuple[float, list[str]]] = []

    def ask(job_ids: Sequence[str]) -> Readers:
        asked.append((time.monotonic(), list(job_ids)))
        return Readers(set(), set(job_ids))

    followed = FollowedJobs(ask, check_s=3600)
    followed.track("job_a")
    deadline = time.monotonic() + 5
    while not asked and time.monotonic() < deadline:
        time.sleep(0.005)
    started = time.monotonic()
    followed.track("job_b")  # the thread sleeps for an hour's check: the start wakes it
    followed.track("job_c")  # the same burst: one ask for both
    while len(asked) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert time.monotonic() - started < 1
    assert [jobs for _, jobs in asked] == [["job_a"], ["job_a", "job_b", "job_c"]]
    followed.track("job_b")  # another stage of a tracked job: nothing new to ask
    time.sleep(0.1)
    assert len(asked) == 2


def test_a_job_counts_as_watched_until_an_answer_covers_it() -> None:
    """A stream opened with the submit is marked before the stage starts, but the worker learns it
    only from its next ask: until then the job's progress is written as for a watched one."""
    answered = threading.Event()
    release = threading.Event()

    def ask(job_ids: Sequence[str]) -> Readers:
        release.wait(5)
        answered.set()
        return Readers(set(), set())  # nobody reads them

    followed = FollowedJobs(ask, check_s=3600)
    followed.track("job_a")
    assert followed.watched("job_a")  # not asked yet
    release.set()
    assert answered.wait(5)
    deadline = time.monotonic() + 5
    while followed.watched("job_a") and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not followed.watched("job_a")  # the answer: nobody
    followed.untrack("job_a")
    followed.track("job_a")  # a later stage of the same job is new again until asked about
    assert followed.watched("job_a")
