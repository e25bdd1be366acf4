"""A hard time limit for code that cannot be interrupted (a C-level engine call).

Soft limits are cooperative (the stage checks at each step); when a call never returns, the only
way to free the worker is to end its process. The watchdog first records why (so the redelivered
message finds the job final and is dropped), then exits; the supervisor starts a fresh worker.

One thread per process watches every limit (a heap of deadlines): a batched worker starts
dozens of stages at a time, and a timer thread each cost a thread start and stop per stage.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

EXIT_CODE = 75
"""Process exit status after a hard time limit (EX_TEMPFAIL)."""


class Deadlines:
    """Calls due at a time, run by one daemon thread unless cancelled first (started again after a
    fork: threads do not survive one)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []  # (due, token); cancelled ones are skipped, and swept
        self._due: dict[int, Callable[[], None]] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def add(self, seconds: float, call: Callable[[], None]) -> int:
        """Run ``call`` in ``seconds`` unless ``cancel`` comes first; returns the token to cancel it."""
        with self._cond:
            token = next(self._tokens)
            self._due[token] = call
            heapq.heappush(self._heap, (time.monotonic() + seconds, token))
            if len(self._heap) > 2 * len(self._due) + 64:  # mostly cancelled: sweep them (amortised)
                self._heap = [entry for entry in self._heap if entry[1] in self._due]
                heapq.heapify(self._heap)
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="omni-watchdog", daemon=True)
                self._thread.start()
            elif self._heap[0][1] == token:  # due before whatever the thread waits for
                self._cond.notify()
        return token

    def cancel(self, token: int) -> None:
        with self._cond:
            self._due.pop(token, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                call = None
                while call is None:
                    while self._heap and self._heap[0][1] not in self._due:
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._cond.wait()
                        continue
                    due, token = self._heap[0]
                    delay = due - time.monotonic()
                    if delay > 0:
                        self._cond.wait(delay)
                        continue
                    heapq.heappop(self._heap)
                    call = self._due.pop(token)
            call()


_DEADLINES = Deadlines()


@contextmanager
def hard_time_limit(seconds: float, on_expire: Callable[[], None], *, exit_process: bool = True) -> Iterator[None]:
    """Run the body; if it is still running after ``seconds``, call ``on_expire`` then exit the process."""

    def fire() -> None:
        try:
            on_expire()
        except Exception:  # the exit must happen even if recording the failure did not
            log.exception("could not record the hard time limit")
        if exit_process:
            log.critical("hard time limit of %gs reached: exiting this worker process", seconds)
            logging.shutdown()
            os._exit(EXIT_CODE)

    token = _DEADLINES.add(seconds, fire)
    try:
        yield
    finally:
        _DEADLINES.cancel(token)
