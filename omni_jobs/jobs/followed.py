"""Which of a worker's running jobs somebody is looking at now, known without asking on the engine's thread.

A reader marks the job it looks at (``keys.job_followed``, with a TTL): an SSE stream as followed
(``STREAM``, omni_jobs.jobs.watch); a GET of a job not yet ended, or a cancel, as looked at
(``LOOK``; a stream's mark stays). A worker spends Redis writes on what only a reader sees while
somebody looks: a stage's frequent progress while its job is followed or looked at, its text deltas
(which only a stream shows) while it is followed. The rest goes out at a slow pace, or with the
stage's result.

``FollowedJobs`` asks the store about all of the process's running jobs at once, every ``check_s``,
from a thread of its own: the engine's thread, which reports for every member of its batch at every
step, only reads a set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

log = logging.getLogger(__name__)

CHECK_S = 0.25
"""How often a worker asks which of its running jobs are looked at: how soon a new reader (or a
cancel) is noticed."""

GATHER_S = 0.02
"""How long the thread waits, once a new job starts, before it asks: the starts of a batch share one
ask, and a job looked at before its stage started gets its progress at full pace from its first steps."""

LOOKED_AT_TTL_S = 10
"""How long a look that is not a stream (a GET of a job not yet ended, a cancel) lasts."""
STREAM, LOOK = b"stream", b"look"
"""The values of a job's mark: a stream follows it; it was looked at otherwise."""


class Readers(NamedTuple):
    """Of some jobs: those a stream follows, and those looked at otherwise (a poll, a cancel)."""

    followed: set[str]
    looked_at: set[str]


Ask = Callable[[Sequence[str]], Readers]
"""Who reads these jobs now (one round trip: ``omni_jobs.jobs.watch.job_readers``)."""


class FollowedJobs:
    """The watched ones among the jobs this process runs (``track``ed), asked every ``check_s``.

    ``ask`` None: no store to ask (one process, tests); every job counts as followed."""

    def __init__(self, ask: Ask | None, *, check_s: float = CHECK_S) -> None:
        self.ask = ask
        self.check_s = check_s
        self._tracked: Counter[str] = Counter()
        self._followed: frozenset[str] = frozenset()
        self._watched: frozenset[str] = frozenset()
        self._unasked: frozenset[str] = frozenset()  # tracked, and no answer covers them yet
        self._new = False  # a job started since the last ask
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def track(self, job_id: str) -> None:
        """A stage of this job starts running here (tracked until as many ``untrack``s)."""
        if self.ask is None:
            return
        with self._cond:
            if job_id not in self._tracked:
                self._new = True
                self._unasked = self._unasked | {job_id}
            self._tracked[job_id] += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="omni-followed", daemon=True)
                self._thread.start()
            self._cond.notify()

    def untrack(self, job_id: str) -> None:
        if self.ask is None:
            return
        with self._cond:
            self._tracked[job_id] -= 1
            if self._tracked[job_id] <= 0:
                del self._tracked[job_id]
                self._unasked = self._unasked - {job_id}

    def watched(self, job_id: str) -> bool:
        """Somebody looks at the job (a stream, a poll, a cancel), as last asked: write its progress often.
        A job started since the last ask counts as watched until an answer covers it: a stream opened
        with the submit sees the first and last step of a stage that ends before the ask returns."""
        return self.ask is None or job_id in self._watched or job_id in self._unasked

    def followed_among(self, job_ids: Iterable[str]) -> set[str]:
        """Those of ``job_ids`` a stream follows, as last asked (no I/O): TextStreams' ``followed``."""
        return set(job_ids) if self.ask is None else set(job_ids) & self._followed

    def refresh(self) -> None:
        """Ask now about every tracked job (the thread's pass; tests call it directly)."""
        assert self.ask is not None
        with self._cond:
            jobs = sorted(self._tracked)
        try:
            readers = self.ask(jobs) if jobs else Readers(set(), set())
        except Exception:  # the store may be down: keep the last answer, the writes report it
            log.warning("could not tell which jobs are followed", exc_info=True)
            return
        self._followed = frozenset(readers.followed)
        self._watched = frozenset(readers.followed | readers.looked_at)
        with self._cond:
            self._unasked = self._unasked - set(jobs)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._tracked))
                self._new = False
            self.refresh()
            with self._cond:
                started = self._cond.wait_for(lambda: self._new, timeout=self.check_s)
            if started:
                time.sleep(GATHER_S)  # the rest of a burst of starts shares this ask
