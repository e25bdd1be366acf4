"""A request batcher shared by the engines: concurrent callers in, one engine call per batch out.

A stage worker holds several tasks at once (a Celery threads pool); each task calls ``submit`` from
its own thread and blocks. One dispatcher thread per batcher collects the waiting requests for up
to ``wait_ms`` (or until ``max_batch_size`` are waiting), groups the compatible ones (``group_key``)
and makes ONE engine call per group, so vLLM and diffusers see batches, not single requests.
While a batch runs, new requests gather for the next one, so a busy engine is never idle waiting.

Batch filling: when a batch is about to start with room left while more work for this process is
known to be on its way (stage tasks it has received whose engine request has not reached a
batcher yet, or messages waiting in its queues while it has free slots: ``Arrivals``), it waits up
to ``fill_wait_ms`` more for them; when nothing else is coming it starts at once, so a lone job's
latency does not grow. A DiT batch (no newcomers once it runs) also waits for a burst still
arriving, while each newcomer pays for its wait (``Batcher._wait_for_burst``).

Tenants take turns within a batch too (``Batcher._by_turns``): each member carries its job's tenant
(``for_tenant``), and a batch with more waiting than it holds takes them one tenant at a time, the one
served longest ago first. So another tenant's jobs that reach a worker behind a backlog ride its next
batch, first in it, instead of after the backlog the worker already holds.

Each caller gets its own result or its own exception: the engine call reports a result or an
exception per member, and when the whole call fails the members are retried one by one, so one bad
request (an over-long prompt, a shape the model refuses) fails only its own job.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from omni_jobs.core import telemetry
from omni_jobs.engines.openmp import release_thread_team

if TYPE_CHECKING:
    from omni_jobs.engines.ar import AREngine, AROutput, ARRequest
    from omni_jobs.engines.dit import DiTLikeEngine, DiTOutput, DiTRequest
    from omni_jobs.pipelines.spec import StageSpec

log = logging.getLogger(__name__)

BURST_QUIET_S = 0.010
"""A burst of requests counts as over once none came for this long at least (``burst_wait_pays``)."""

R = TypeVar("R")
O = TypeVar("O")
K = TypeVar("K")

ProgressFn = Callable[[int, int], None]
"""A member's own progress callback ``(done, total)``; it may raise to cancel that member only."""

_tenant: ContextVar[str | None] = ContextVar("omni_jobs_batch_tenant", default=None)
TURNS_KEPT = 1024
"""Tenants whose last turn a batcher remembers (the least recently served are forgotten first)."""


def current_tenant() -> str | None:
    """The tenant of what this thread submits (``for_tenant``): what a batcher elsewhere is told."""
    return _tenant.get()


@contextmanager
def for_tenant(tenant: str | None) -> Iterator[None]:
    """Around a job's engine calls (StageRunner): what this thread submits to a batcher is ``tenant``'s.
    A context, not an argument, so that every engine path (AR, DiT, code2wav, transcription) carries it
    without each executor passing it on; an engine in a process of its own is fed from this thread too."""
    token = _tenant.set(tenant)
    try:
        yield
    finally:
        _tenant.reset(token)


@dataclass(frozen=True)
class BatchPolicy:
    """How a batcher batches: the largest batch, and how long the first request waits for company."""

    max_batch_size: int = 16
    wait_ms: float = 10.0
    idle_release_s: float = 1.0
    """How long its thread waits without work before it hands back its OpenMP team (0: never); an idle
    engine's team slows every other engine of the process (omni_jobs.engines.openmp)."""
    burst_fill: float = 0.0
    """For engines whose running batch takes no newcomers (DiT): the most a batch with room left waits
    for a burst still arriving, as a fraction of its group's longest recent batch run, counted from its
    first request (0: never waits for a burst). Whether to wait is ``Batcher._wait_for_burst``'s."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.wait_ms < 0:
            raise ValueError(f"wait_ms must be >= 0, got {self.wait_ms}")
        if self.idle_release_s < 0:
            raise ValueError(f"idle_release_s must be >= 0, got {self.idle_release_s}")
        if not 0 <= self.burst_fill <= 1:
            raise ValueError(f"burst_fill must be between 0 and 1, got {self.burst_fill}")


@dataclass
class Member(Generic[R, O]):
    """One caller's request inside a batch, with its own progress callback, and then its outcome."""

    request: R
    progress: ProgressFn | None = None
    tenant: str | None = None
    """Whose job it is (``for_tenant``; None in one process): batches take tenants in turn."""
    enqueued_at: float = field(default_factory=time.monotonic)
    result: O | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def report(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)

    def settle(self, outcome: O | BaseException) -> None:
        """Its own output, or the exception it alone failed with."""
        if isinstance(outcome, BaseException):
            self.error = outcome
        else:
            self.result = outcome


@dataclass
class _GroupRuns:
    """A batcher's record of one group's batches: every size it has run, and its recent warm runs."""

    sizes: set[int] = field(default_factory=set)
    warm: list[tuple[int, float]] = field(default_factory=list)
    """(size, run time) of its last 16 batches, bar each size's first (``Batcher._ran``)."""


class _Wakeable(Protocol):
    def wake(self) -> None: ...


def fixed_cost_s(runs: Sequence[tuple[int, float]]) -> float | None:
    """The fixed part ``a`` of a batch's run time ``a + b * size``, fitted by least squares over the
    least time seen for each size (a cold first call, or a run slowed by the process's other threads,
    only adds time: one cold batch of 32 at 2.9 s among warm ones at 1.5-1.8 s made the fit over all
    runs give ``a`` = 0, the least times 0.25 s); None until two sizes were seen. Kept within [0, the
    shortest run]."""
    best: dict[int, float] = {}
    for n, t in runs:
        best[n] = min(t, best.get(n, t))
    if len(best) < 2:
        return None
    mean_n = sum(best) / len(best)
    mean_t = sum(best.values()) / len(best)
    b = sum((n - mean_n) * (t - mean_t) for n, t in best.items()) / sum((n - mean_n) ** 2 for n in best)
    return min(max(mean_t - b * mean_n, 0.0), min(best.values()))


def burst_bound_s(runs: Sequence[tuple[int, float]], fixed_s: float, burst_fill: float) -> float:
    """How long after its first request a burst's batch waits at most: never past the fixed cost ``fixed_s``
    (no newcomer can pay for more), nor ``burst_fill`` of the group's longest recent run ``runs`` ((size,
    seconds) each): the longest, not the last, since a straggler's batch of one may have run last."""
    return min(fixed_s, burst_fill * max(t for _, t in runs))


def burst_wait_pays(arrived: Sequence[float], now: float, fixed_s: float) -> bool:
    """Whether a batch whose members arrived at ``arrived`` (ascending) should wait for the next one:
    they are still coming, and often enough that ``n * gap < fixed_s`` (``Batcher._wait_for_burst``).
    Still coming: none for at most four of their mean gaps, an eighth of the fixed cost, or
    ``BURST_QUIET_S``, whichever is longest (a worker receives a burst in clumps: gaps of 20-25 ms
    between clumps arriving 3-4 ms apart were seen)."""
    if len(arrived) < 2:
        return False  # a lone request: no pace to go by
    gap = (arrived[-1] - arrived[0]) / (len(arrived) - 1)
    patience = max(4 * gap, fixed_s / 8, BURST_QUIET_S)
    return now - arrived[-1] <= patience and len(arrived) * gap < fixed_s


class Arrivals:
    """Work on its way to this process's batchers: what a starting batch may wait for (batch filling).

    A stage worker reports each stage task it receives (``received``, from the broker consumer) and
    runs it inside ``task``; the task counts as *arriving* until its thread submits to a batcher (or
    the task ends without an engine call: a cache hit, a skipped attempt, an error). ``probe``
    (optional) says how many messages wait in the worker's queues; they count only while the worker
    has free slots to take them. ``fill_wait_ms`` 0 (the default, and in-process use): no filling.
    """

    def __init__(self, fill_wait_ms: float = 0.0, *, probe: Callable[[], int] | None = None, capacity: int = 0,
                 expire_s: float = 30.0) -> None:
        self.fill_wait_ms = fill_wait_ms
        self.probe = probe
        self.capacity = capacity
        self.expire_s = expire_s
        self._lock = threading.Lock()
        self._waiting: dict[str, float] = {}  # token -> received at (monotonic)
        self._active = 0  # tasks inside ``task``
        self._local = threading.local()
        self._batchers: weakref.WeakSet[_Wakeable] = weakref.WeakSet()

    def configure(self, fill_wait_ms: float, *, probe: Callable[[], int] | None = None, capacity: int = 0) -> None:
        self.fill_wait_ms, self.probe, self.capacity = fill_wait_ms, probe, capacity

    def received(self, token: str) -> None:
        with self._lock:
            self._waiting.setdefault(token, time.monotonic())

    @contextmanager
    def task(self, token: str) -> Iterator[None]:
        """Around one stage task in its own thread: arriving until its first ``submit``."""
        self.received(token)
        with self._lock:
            self._active += 1
        self._local.token = token
        try:
            yield
        finally:
            self._local.token = None
            with self._lock:
                self._active -= 1
                left = self._waiting.pop(token, None) is not None
            if left:  # it never reached a batcher: a filling batch must not wait for it
                for b in list(self._batchers):
                    b.wake()

    def submitted(self) -> None:
        """The calling thread's task reached a batcher (called by ``Batcher.submit``, under its lock)."""
        token = getattr(self._local, "token", None)
        if token is not None:
            self._local.token = None
            with self._lock:
                self._waiting.pop(token, None)

    def arriving(self) -> int:
        """Tasks received and not yet at a batcher (entries older than ``expire_s`` are dropped)."""
        with self._lock:
            if self._waiting:
                old = time.monotonic() - self.expire_s
                for token in [t for t, at in self._waiting.items() if at < old]:
                    del self._waiting[token]
            return len(self._waiting)

    def expected(self) -> int:
        """Requests still on their way: arriving tasks, plus queued messages the free slots can take."""
        n = self.arriving()
        if self.probe is not None and self.capacity > 0:
            with self._lock:
                free = self.capacity - max(self._active, len(self._waiting))
            if free > 0:
                try:
                    n += min(free, self.probe())
                except Exception:  # a broker hiccup must not stop batching
                    log.debug("queue depth probe failed", exc_info=True)
        return n

    def watch(self, batcher: _Wakeable) -> None:
        self._batchers.add(batcher)


arrivals = Arrivals()
"""This process's arrivals (stage workers configure it at start: workers/tasks.py)."""
_arrivals = arrivals  # the default of Batcher's ``arrivals`` argument, which hides the name there


RunBatch = Callable[[Sequence[Member[R, O]]], Sequence[O | BaseException]]
"""Runs one batch; returns, per member in order, its output or the exception it alone failed with."""


class Batcher(Generic[R, O]):
    """Coalesces concurrent ``submit`` calls into batched ``run_batch`` calls (one thread per batcher)."""

    def __init__(self, run_batch: RunBatch[R, O], policy: BatchPolicy | None = None, *,
                 group_key: Callable[[R], Hashable] | None = None, rank: Callable[[R], int] | None = None,
                 name: str = "batcher",
                 arrivals: Arrivals | None = None, release_team: Callable[[], object] = release_thread_team,
                 turn: Callable[[], AbstractContextManager[object]] = nullcontext,
                 on_done: Callable[[Sequence[Member[R, O]]], None] | None = None) -> None:
        self.run_batch = run_batch
        self.on_done = on_done
        """Hears of each batch once its members are settled, before they are told (an engine process
        answers its worker for the whole batch at once)."""
        self.turn = turn
        """The engine to itself and its turn on shared cores (``DiTEngine.turn``, omni_jobs.engines.turns),
        for an engine whose running batch takes no newcomers: a batch takes both before its members are
        final, then takes in the requests of its group that came while it waited (an AR step of
        another worker can take 0.6 s, another batch of the same engine seconds)."""
        self.release_team = release_team
        self.released = 0
        """How many times its thread handed back its OpenMP team, idle (for tests and the benchmark)."""
        self.policy = policy or BatchPolicy()
        self.group_key = group_key or (lambda _r: None)
        self.rank = rank
        """Which group runs next: that of the waiting request of the lowest rank, then of the tenant served
        longest ago, the earliest of equals (None: every request ranks the same)."""
        self.name = name
        self.batches: list[int] = []
        """Sizes of the batches run so far (the last 1000), for tests and the benchmark."""
        self._pending: list[Member[R, O]] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.arrivals: Arrivals = arrivals if arrivals is not None else _arrivals
        self.arrivals.watch(self)
        self.filled_s: list[float] = []
        """Time each batch waited past its window to fill (the last 1000), for tests and the benchmark."""
        self._groups: dict[Hashable, _GroupRuns] = {}  # what each group's batches took (``_ran``)
        self._served: dict[str | None, int] = {}  # tenant -> its last turn (``_by_turns``)
        self._turns = itertools.count()

    def submit(self, request: R, progress: ProgressFn | None = None) -> O:
        """Block until this request has run in some batch; return its output or raise its own error."""
        member = self.put(request, progress, tenant=_tenant.get())
        member.done.wait()
        if member.error is not None:
            raise member.error
        if member.result is None:
            raise RuntimeError(f"{self.name}: the batch ended without an output for this request")
        return member.result

    def put(self, request: R, progress: ProgressFn | None = None, *, tenant: str | None = None) -> Member[R, O]:
        """Queue this request without waiting: its member is settled, then ``done``, when its batch has run
        (``on_done`` hears of the whole batch first)."""
        member: Member[R, O] = Member(request, progress, tenant)
        with self._cond:
            self._pending.append(member)
            self.arrivals.submitted()
            self._ensure_thread()
            self._cond.notify_all()
        return member

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def take_more(self, like: R, limit: int) -> list[Member[R, O]]:
        """Waiting requests of ``like``'s group (at most ``limit``), for a running batch to take in."""
        if limit <= 0:
            return []
        with self._cond:
            taken = self._take_group(self.group_key(like), limit)
        if taken:
            self.batches = [*self.batches[-999:], -len(taken)]  # negative: joined a running batch
        return taken

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=f"{self.name}-dispatch", daemon=True)
            self._thread.start()

    def _next_batch(self) -> list[Member[R, O]]:
        """Wait for requests, then for the window to fill; take the next group (``_head``), tenants in turn."""
        with self._cond:
            release_at: float | None = None  # the last batch left this thread a team, to hand back when idle
            if self.policy.idle_release_s > 0:
                release_at = time.monotonic() + self.policy.idle_release_s
            while not self._pending:
                if release_at is None:
                    self._cond.wait()
                elif (left := release_at - time.monotonic()) > 0:
                    self._cond.wait(left)
                else:
                    release_at = None
                    self._cond.release()  # joining the team's threads: a submit need not wait for it
                    try:
                        self.release_team()
                    finally:
                        self._cond.acquire()
                    self.released += 1
            deadline = self._head().enqueued_at + self.policy.wait_ms / 1000
            while len(self._pending) < self.policy.max_batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._fill()
            return self._take_group(self.group_key(self._head().request), self.policy.max_batch_size)

    def _head(self) -> Member[R, O]:
        """The waiting request whose group runs next (the lock held, something waiting): of the lowest rank,
        the earliest request of the tenant served longest ago."""
        first = self._pending
        if self.rank is not None:
            rank = self.rank
            lowest = min(rank(m.request) for m in first)
            first = [m for m in first if rank(m.request) == lowest]
        served = self._served
        return min(first, key=lambda m: served.get(m.tenant, -1))  # min keeps the earliest of equals

    def _take_group(self, key: Hashable, limit: int) -> list[Member[R, O]]:
        """Take up to ``limit`` waiting requests of group ``key``, tenants in turn (the lock held)."""
        taken = self._by_turns([m for m in self._pending if self.group_key(m.request) == key], limit)
        chosen = {id(m) for m in taken}
        self._pending = [m for m in self._pending if id(m) not in chosen]
        return taken

    def _by_turns(self, waiting: list[Member[R, O]], limit: int) -> list[Member[R, O]]:
        """Up to ``limit`` of ``waiting`` (in arrival order), one at a time from the tenant served longest ago,
        each tenant's in arrival order; a tenant never served goes first. The turns last from batch to batch.

        The scheduler releases tenants' work in turn, but a stage worker holds more than a batch (a batch runs
        while the next waits, full): by arrival alone, another tenant's jobs that reach the worker then wait
        for every one of the first tenant's it holds. With one tenant this is arrival order."""
        queues: dict[str | None, list[Member[R, O]]] = {}
        for m in waiting:
            queues.setdefault(m.tenant, []).append(m)
        served = self._served
        if len(queues) == 1:  # one tenant: arrival order (its turn is still counted)
            taken = waiting[:limit]
            served[waiting[0].tenant] = next(self._turns)
        else:
            at = dict.fromkeys(queues, 0)
            taken = []
            while len(taken) < limit and queues:
                tenant = min(queues, key=lambda t: served.get(t, -1))  # ties: the tenant whose request came first
                taken.append(queues[tenant][at[tenant]])
                at[tenant] += 1
                served[tenant] = next(self._turns)
                if at[tenant] == len(queues[tenant]):
                    del queues[tenant]
        if len(served) > TURNS_KEPT:
            for tenant in sorted(served, key=served.__getitem__)[: len(served) - TURNS_KEPT // 2]:
                del served[tenant]
        return taken

    def _fill(self) -> None:
        """Past the window with room left: wait up to ``fill_wait_ms`` while more requests are on their
        way, then for a burst that is still arriving (``_wait_for_burst``).

        A batch that takes no newcomers once it runs (``burst_fill`` > 0) waits for neither past its
        group's fixed cost per batch: a request that comes later costs one more batch, that is, that
        fixed cost and no more. Until that cost can be fitted, a batch of a group that has run starts
        after its window, and its size teaches the fit (``_wait_for_burst``)."""
        if len(self._pending) >= self.policy.max_batch_size:
            return
        started = time.monotonic()
        fill_s = self.arrivals.fill_wait_ms / 1000
        key = self.group_key(self._head().request)
        group = self._groups.get(key)
        runs = group.warm if group is not None else []
        fixed_s = fixed_cost_s(runs)
        if self.policy.burst_fill > 0 and runs:
            fill_s = min(fill_s, fixed_s if fixed_s is not None else 0.0)
        deadline = started + fill_s
        while fill_s > 0 and len(self._pending) < self.policy.max_batch_size:
            left = deadline - time.monotonic()
            if left <= 0 or self.arrivals.expected() <= 0:
                break
            self._cond.wait(min(left, 0.005))  # submits wake it; queued messages turn into arrivals unseen
        self._wait_for_burst(key, runs, fixed_s)
        if time.monotonic() - started > 0.0005:
            self.filled_s = [*self.filled_s[-999:], time.monotonic() - started]

    def _wait_for_burst(self, key: Hashable, runs: Sequence[tuple[int, float]], fixed_s: float | None) -> None:
        """Wait while the first request's group ``key`` keeps arriving and each newcomer is worth its wait
        (``runs``: the group's recent warm batches; ``fixed_s``: the fixed cost fitted from them).

        A batch that takes no newcomers once it runs costs a fixed part ``a`` plus a part per member
        (fitted from the group's recent batches, ``fixed_cost_s``; ``python -m bench.batch_curve``
        measures an engine's): a DiT batch of 8 took 117 ms per image on one CPU, one of 32 took 82; where
        ``a`` is about 0 (a compute-bound DiT) a part batch costs nothing and no wait pays. Starting now
        serves ``n`` requests per ``a + b*n``; while requests arrive every ``gap`` seconds, waiting serves
        more per second as long as ``n * gap < a`` (the derivative of (n + t/gap) / (t + a + b*(n + t/gap))
        at t = 0). So a burst reaching an idle
        worker over a few hundred ms runs as one full batch instead of its first few members and then
        the rest; a lone request, a burst that stopped, or a trickle too slow to pay starts at once. The
        wait never passes ``a`` (no newcomer can pay for more) nor ``burst_fill`` of the group's longest recent run.

        The fit counts warm runs only (``_ran``). Until it has two sizes, ``a`` is unknown and the batch
        starts: a size other than the one seen is what lets the fit form. At worst that costs a fresh
        worker's first bursts one more fixed cost each, until a size repeats. A stand-in for ``a``
        (``burst_fill`` of the longest run) held every burst to full batches instead, so a worker whose
        batches were all full never learnt its cost. Before any warm run of the group nothing is known,
        and a batch starts after the fill wait."""
        if self.policy.burst_fill <= 0 or fixed_s is None or fixed_s <= 0:  # no fit yet (above), or nothing to amortise
            return
        deadline = self._head().enqueued_at + burst_bound_s(runs, fixed_s, self.policy.burst_fill)
        while True:
            arrived = [m.enqueued_at for m in self._pending if self.group_key(m.request) == key]
            at = time.monotonic()
            if (len(arrived) >= self.policy.max_batch_size or at >= deadline
                    or not burst_wait_pays(arrived, at, fixed_s)):
                log.debug("%s: a batch of %d starts %.0f ms after its first request (fixed cost %.0f ms, "
                          "deadline %s)", self.name, len(arrived), 1000 * (at - arrived[0]), 1000 * fixed_s,
                          "reached" if at >= deadline else "not reached")
                return
            self._cond.wait(min(deadline - at, 0.005))  # submits wake it sooner

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            key = self.group_key(batch[0].request)
            with self.turn():
                if len(batch) < self.policy.max_batch_size:
                    with self._cond:
                        batch += self._take_group(key, self.policy.max_batch_size - len(batch))
                self.batches = [*self.batches[-999:], len(batch)]
                started = time.monotonic()
                try:
                    self._run(batch)
                finally:
                    try:  # recorded before its members go on: what they read next counts this batch
                        run_s = time.monotonic() - started
                        self._ran(key, len(batch), run_s)
                        telemetry.batch_ran(self.name, started - batch[0].enqueued_at, run_s)
                    finally:
                        try:
                            if self.on_done is not None:
                                self.on_done(batch)
                        finally:
                            for m in batch:
                                m.done.set()

    def _ran(self, key: Hashable, size: int, run_s: float) -> None:
        """Remember a group's recent batches (the last 16 of each of the last 64 groups), bar each size's
        first: the first call at a batch size allocates for it (oneDNN's primitives for its shapes, the
        allocator's pools), and a worker's cold batches of 26 and 23 took 6.2 and 4.4 s where a warm 32
        took 1.9. Counted, they made the fit's fixed cost 0.48 s where the engine's is 0.033
        (``python -m bench.batch_curve``), and every burst waited to fill its batches."""
        group = self._groups.pop(key, None) or _GroupRuns()
        self._groups[key] = group  # the most recent last: the least recently run group goes first
        if len(self._groups) > 64:
            del self._groups[next(iter(self._groups))]
        if size not in group.sizes:
            group.sizes.add(size)
            return
        group.warm = [*group.warm[-15:], (size, run_s)]

    def _run(self, batch: list[Member[R, O]]) -> None:
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
            m.settle(r)


_ar_batchers: weakref.WeakKeyDictionary[AREngine, dict[BatchPolicy, Batcher[ARRequest, AROutput]]] = \
    weakref.WeakKeyDictionary()
_dit_batchers: weakref.WeakKeyDictionary[DiTLikeEngine, dict[BatchPolicy, Batcher[DiTRequest, DiTOutput]]] = \
    weakref.WeakKeyDictionary()
_batchers_lock = threading.Lock()


def batcher_for(batchers: weakref.WeakKeyDictionary[K, dict[BatchPolicy, Batcher[R, O]]], engine: K,
                policy: BatchPolicy, make: Callable[[BatchPolicy], Batcher[R, O]]) -> Batcher[R, O]:
    """The one batcher of this engine instance and policy in this process (made on first use)."""
    with _batchers_lock:
        per_engine = batchers.setdefault(engine, {})
        if policy not in per_engine:
            per_engine[policy] = make(policy)
        return per_engine[policy]


# --- the engines' batch functions ---

def ar_batcher(engine: AREngine, policy: BatchPolicy) -> Batcher[ARRequest, AROutput]:
    """Batcher of an AREngine: any requests batch together (vLLM takes mixed sampling params), and
    requests that arrive while a batch runs join it between engine steps (continuous batching),
    up to ``max_batch_size`` running at once; each caller returns as soon as its request is done."""
    holder: list[Batcher[ARRequest, AROutput]] = []

    def run(batch: Sequence[Member[ARRequest, AROutput]]) -> list[AROutput | BaseException]:
        members = list(batch)
        by_id = {m.request.request_id: m for m in members}

        def on_progress(request_id: str, done: int, total: int) -> None:
            by_id[request_id].report(done, total)

        def more(live: int) -> list[ARRequest]:
            joined = holder[0].take_more(members[0].request, policy.max_batch_size - live)
            members.extend(joined)
            by_id.update({m.request.request_id: m for m in joined})
            return [m.request for m in joined]

        def on_result(i: int, result: AROutput | BaseException) -> None:
            m = members[i]
            m.settle(result)
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

    def make(p: BatchPolicy) -> Batcher[ARRequest, AROutput]:
        holder.append(Batcher(run, replace(p, burst_fill=0.0), name="ar"))  # a running batch takes newcomers
        return holder[0]

    return batcher_for(_ar_batchers, engine, policy, make)


class _AllMembersStopped(Exception):
    """Every member of a diffusers call was canceled: stop the call at this step."""


def dit_batcher(engine: DiTLikeEngine, policy: BatchPolicy) -> Batcher[DiTRequest, DiTOutput]:
    """Batcher of a DiTEngine (or the benchmark's GPU-shaped engine): only requests with the same call settings
    (size, steps, guidance, negative prompt, strength, duration, embedding shape) share a pipeline call; each
    keeps its seed."""
    from omni_jobs.engines.dit import group_key as _group_key

    def run(batch: Sequence[Member[DiTRequest, DiTOutput]]) -> list[DiTOutput | BaseException]:
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

    return batcher_for(_dit_batchers, engine, policy,
                       lambda p: Batcher(run, p, group_key=_group_key, name="dit", turn=engine.turn))


@dataclass(frozen=True)
class BatchDefaults:
    """Per-stage batching settings: the settings' defaults, overridden by a stage's ``batching:`` block."""

    max_batch_size: int = 16
    wait_ms: float = 10.0
    max_in_flight: int = 16
    idle_release_s: float = 1.0
    burst_fill: float = 0.0

    def policy(self, stage: StageSpec) -> BatchPolicy:
        spec = stage.batching
        return BatchPolicy(
            max_batch_size=spec.max_batch_size or self.max_batch_size,
            wait_ms=self.wait_ms if spec.wait_ms is None else spec.wait_ms,
            idle_release_s=self.idle_release_s,
            burst_fill=self.burst_fill,
        )

    def in_flight(self, stage: StageSpec) -> int:
        return int(stage.batching.max_in_flight or self.max_in_flight)
