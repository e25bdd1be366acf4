"""Group commit: calls that arrive while another is on its way to Redis go out together, next.

A stage worker's threads start and finish their jobs in bursts: a batch's 32 requests end at once,
and the next batch's tasks start while it runs. Each start and each completion is a commit, a round
trip to Redis, and each round trip wakes Redis, another process, beside the engine's batch: about
1 ms of the batch's time each, ten times the CPU it takes (``python -m bench.wakeups``;
docs/decisions/another-process-wakeups.md). So one thread at a time sends: the first caller sends its own at
once; whoever calls meanwhile waits, and the first of them, once that round trip is back, sends all
that waited in one pipeline. Nothing waits for a timer: a lone call goes out as before, and a burst
needs a few round trips instead of one each.

Each call keeps its own answer (its own script reply, or its own error). A failure of the round trip
itself (the connection) is every call's of that round trip, as it would have been had each sent its
own: none of them knows whether its write applied, and each handles that as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

A = TypeVar("A")
R = TypeVar("R")


class _Call(Generic[A, R]):
    __slots__ = ("arg", "done", "error", "leads", "reply")

    def __init__(self, arg: A) -> None:
        self.arg = arg
        self.done = threading.Event()
        self.leads = False
        self.reply: R | None = None
        self.error: BaseException | None = None

    def outcome(self) -> R:
        if self.error is not None:
            raise self.error
        return self.reply  # type: ignore[return-value]  # set with error None


class GroupCommit(Generic[A, R]):
    """``call(arg)`` sends ``arg`` through ``send_one`` (alone) or ``send_many`` (with those that waited
    meanwhile), one sender at a time. ``send_many`` answers in order, an exception in place of a reply
    that failed on its own."""

    def __init__(self, send_one: Callable[[A], R], send_many: Callable[[Sequence[A]], Sequence[R | BaseException]]
                 ) -> None:
        self._send_one = send_one
        self._send_many = send_many
        self._lock = threading.Lock()
        self._waiting: list[_Call[A, R]] = []
        self._sending = False
        self.round_trips = 0
        """Round trips sent (calls sent together count once): what the tests and the curious read."""

    def call(self, arg: A) -> R:
        mine: _Call[A, R] = _Call(arg)
        with self._lock:
            self._waiting.append(mine)
            leads = not self._sending
            self._sending = True
        if not leads:
            mine.done.wait()
            if not mine.leads:
                return mine.outcome()
        with self._lock:
            group, self._waiting = self._waiting, []
        try:
            self._send(group)
        finally:
            with self._lock:
                if self._waiting:  # the next sender: the first of those that came meanwhile
                    self._waiting[0].leads = True
                    self._waiting[0].done.set()
                else:
                    self._sending = False
            for call in group:
                if call is not mine:
                    call.done.set()
        return mine.outcome()

    def _send(self, group: list[_Call[A, R]]) -> None:
        """Send ``group`` in one round trip; each call gets its reply or error."""
        self.round_trips += 1
        try:
            if len(group) == 1:
                group[0].reply = self._send_one(group[0].arg)
                return
            replies = self._send_many([call.arg for call in group])
        except BaseException as exc:  # noqa: BLE001 - the round trip failed (even interrupted): every call of it
            for call in group:
                call.error = exc
            return
        for call, reply in zip(group, replies, strict=True):
            if isinstance(reply, BaseException):
                call.error = reply
            else:
                call.reply = reply
