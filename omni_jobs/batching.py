"""A request batcher shared by the engines: concurrent callers in, one engine call per batch out.

A stage worker holds several tasks at once (a Celery threads pool); each task calls ``submit`` from
its own thread and blocks. One dispatcher thread per batcher collects the waiting requests for up
to ``wait_ms`` (or until ``max_batch_size`` are waiting), groups the compatible ones (``group_key``)
and makes ONE engine call per group, so vLLM and diffusers see batches, not single requests.
While a batch runs, new requests gather for the next one, so a busy engine is never idle waiting.

Each caller gets its own result or its own exception: the engine call reports a result or an
exception per member, and when the whole call fails the members are retried one by one, so one bad
request (an over-long prompt, a shape the model refuses) fails only its own job.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

R = TypeVar("R")
O = TypeVar("O")

ProgressFn = Callable[[int, int], None]
"""A member's own progress callback ``(done, total)``; it may raise to cancel that member only."""


@dataclass(frozen=True)
class BatchPolicy:
    """How a batcher batches: the largest batch, and how long the first request waits for company."""

    max_batch_size: int = 16
    wait_ms: float = 10.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.wait_ms < 0:
            raise ValueError(f"wait_ms must be >= 0, got {self.wait_ms}")


@dataclass
class Member(Generic[R]):
    """One caller's request inside a batch, with its own progress callback."""

    request: R
    progress: ProgressFn | None = None
    enqueued_at: float = field(default_factory=time.monotonic)
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def report(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)


RunBatch = Callable[[Sequence[Member[R]]], Sequence[Any]]
"""Runs one batch; returns, per member in order, its output or the exception it alone failed with."""


class Batcher(Generic[R, O]):
    """Coalesces concurrent ``submit`` calls into batched ``run_batch`` calls (one thread per batcher)."""

    def __init__(self, run_batch: RunBatch[R], policy: BatchPolicy | None = None, *,
                 group_key: Callable[[R], Hashable] | None = None, name: str = "batcher") -> None:
        self.run_batch = run_batch
        self.policy = policy or BatchPolicy()
        self.group_key = group_key or (lambda _r: None)
        self.name = name
        self.batches: list[int] = []
        """Sizes of the batches run so far (the last 1000), for tests and the benchmark."""
        self._pending: list[Member[R]] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, request: R, progress: ProgressFn | None = None) -> O:
        """Block until this request has run in some batch; return its output or raise its own error."""
        member: Member[R] = Member(request, progress)
        with self._cond:
            self._pending.append(member)
            self._ensure_thread()
            self._cond.notify_all()
        member.done.wait()
        if member.error is not None:
            raise member.error
        return member.result  # type: ignore[no-any-return]

    def take_more(self, like: R, limit: int) -> list[Member[R]]:
        """Waiting requests of ``like``'s group (at most ``limit``), for a running batch to take in."""
        if limit <= 0:
            return []
        key = self.group_key(like)
        with self._cond:
            taken: list[Member[R]] = []
            rest: list[Member[R]] = []
            for m in self._pending:
                if len(taken) < limit and self.group_key(m.request) == key:
                    taken.append(m)
                else:
                    rest.append(m)
            self._pending = rest
        if taken:
            self.batches = [*self.batches[-999:], -len(taken)]  # negative: joined a running batch
        return taken

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=f"{self.name}-dispatch", daemon=True)
            self._thread.start()

    def _next_batch(self) -> list[Member[R]]:
        """Wait for requests, then for the window to fill; take the first request's group (in order)."""
        with self._cond:
            while not self._pending:
                self._cond.wait()
            deadline = self._pending[0].enqueued_at + self.policy.wait_ms / 1000
            while len(self._pending) < self.policy.max_batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            key = self.group_key(self._pending[0].request)
            batch: list[Member[R]] = []
            rest: list[Member[R]] = []
            for m in self._pending:
                if len(batch) < self.policy.max_batch_size and self.group_key(m.request) == key:
                    batch.append(m)
                else:
                    rest.append(m)
            self._pending = rest
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            self.batches = [*self.batches[-999:], len(batch)]
            try:
                self._run(batch)
            finally:
                for m in batch:
                    m.done.set()

    def _run(self, batch: list[Member[R]]) -> None:
        try:
            results = list(self.run_batch(batch))
            if len(results) != len(batch):
                raise RuntimeError(f"{self.name}: {len(results)} results for a batch of {len(batch)}")
        except BaseException as exc:  # noqa: BLE001 - handed to the callers, never swallowed
            if len(batch) == 1:
                batch[0].error = exc
                return
            log.warning("%s: a batch of %d failed (%s); retrying its members one by one", self.name, len(batch), exc)
            for m in batch:
                self._run([m])
            return
        for m, r in zip(batch, results, strict=True):
            if isinstance(r, BaseException):
                m.error = r
            else:
                m.result = r


_batchers: weakref.WeakKeyDictionary[Any, dict[BatchPolicy, Batcher[Any, Any]]] = weakref.WeakKeyDictionary()
_batchers_lock = threading.Lock()


def batcher_for(engine: Any, policy: BatchPolicy, make: Callable[[BatchPolicy], Batcher[Any, Any]]) -> Batcher[Any, Any]:
    """The one batcher of this engine instance and policy in this process (made on first use)."""
    with _batchers_lock:
        per_engine = _batchers.setdefault(engine, {})
        if policy not in per_engine:
            per_engine[policy] = make(policy)
        return per_engine[policy]


# --- the engines' batch functions ---

def ar_batcher(engine: Any, policy: BatchPolicy) -> Batcher[Any, Any]:
    """Batcher of an AREngine: any requests batch together (vLLM takes mixed sampling params), and
    requests that arrive while a batch runs join it between engine steps (continuous batching),
    up to ``max_batch_size`` running at once; each caller returns as soon as its request is done."""
    holder: list[Batcher[Any, Any]] = []

    def run(batch: Sequence[Member[Any]]) -> list[Any]:
        members = list(batch)
        by_id = {m.request.request_id: m for m in members}

        def on_progress(request_id: str, done: int, total: int) -> None:
            by_id[request_id].report(done, total)

        def more(live: int) -> list[Any]:
            joined = holder[0].take_more(members[0].request, policy.max_batch_size - live)
            members.extend(joined)
            by_id.update({m.request.request_id: m for m in joined})
            return [m.request for m in joined]

        def on_result(i: int, result: Any) -> None:
            m = members[i]
            if isinstance(result, BaseException):
                m.error = result
            else:
                m.result = result
            m.done.set()

        try:
            results = list(engine.generate_each([m.request for m in batch], on_progress=on_progress, more=more,
                                                on_result=on_result))
        except BaseException as exc:
            for m in members[len(batch):]:  # joiners are not retried by the batcher: hand them the error
                if not m.done.is_set():
                    m.error = exc
                    m.done.set()
            raise
        return results[: len(batch)]

    def make(p: BatchPolicy) -> Batcher[Any, Any]:
        holder.append(Batcher(run, p, name="ar"))
        return holder[0]

    return batcher_for(engine, policy, make)


class _AllMembersStopped(Exception):
    """Every member of a diffusers call was canceled: stop the call at this step."""


def dit_batcher(engine: Any, policy: BatchPolicy) -> Batcher[Any, Any]:
    """Batcher of a DiTEngine: only requests with the same call settings (size, steps, guidance,
    negative prompt, strength, duration, embedding shape) share a pipeline call; each keeps its seed."""
    from omni_jobs.engines.dit import group_key as _group_key

    def run(batch: Sequence[Member[Any]]) -> list[Any]:
        stopped: dict[int, BaseException] = {}

        def on_step(done: int, total: int) -> None:
            # one step of the shared call is a step of every member; a member whose callback raises
            # (canceled, deadline) is dropped from reporting and gets its error; the call goes on
            # for the others and stops only when no member wants it any more.
            for i, m in enumerate(batch):
                if i in stopped:
                    continue
                try:
                    m.report(done, total)
                except BaseException as exc:  # noqa: BLE001 - handed to that member alone
                    stopped[i] = exc
            if len(stopped) == len(batch):
                raise _AllMembersStopped()

        try:
            outputs = engine.generate([m.request for m in batch], on_step=on_step)
        except _AllMembersStopped:
            return [stopped[i] for i in range(len(batch))]
        return [stopped.get(i, out) for i, out in enumerate(outputs)]

    return batcher_for(engine, policy, lambda p: Batcher(run, p, group_key=_group_key, name="dit"))


@dataclass(frozen=True)
class BatchDefaults:
    """Per-stage batching settings: the settings' defaults, overridden by a stage's ``batching:`` block."""

    max_batch_size: int = 16
    wait_ms: float = 10.0
    max_in_flight: int = 16

    def policy(self, stage: Any) -> BatchPolicy:
        spec = stage.batching
        return BatchPolicy(
            max_batch_size=spec.max_batch_size or self.max_batch_size,
            wait_ms=self.wait_ms if spec.wait_ms is None else spec.wait_ms,
        )

    def in_flight(self, stage: Any) -> int:
        return int(stage.batching.max_in_flight or self.max_in_flight)
