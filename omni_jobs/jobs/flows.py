"""One I/O path: a store operation of several steps is written once, as a flow; a driver runs it.

A flow is a generator that yields the store operations it needs, one at a time (small frozen
values: ``Commit``, ``CommitPlaced``, ``Get``, ``Idempotency``, ``QueuePosition``, ``Oldest``), and
receives each one's answer, or its error thrown in where it yielded: it decides, the driver does the
I/O. ``drive(store, flow)`` runs it on the calling thread (``store.run``: a worker, ``Omni``, the
CLI); ``adrive(store, flow)`` on an event loop (``await store.arun``: the API). So the submit's
decision (commit; on a conflict, read the rate window's oldest entry, the Idempotency-Key's record,
the earlier job, its queue position; once more when the record expired) exists once, and its sync
and async forms cannot drift apart.

Why not an async store with a sync adapter (one event-loop hop per call): the stage workers are
sync threads that commit on every step of a job (start, progress, result), and their commits go
together in one round trip (group_commit): an adapter would put a loop hop, a thread switch, on
each of them, for the sake of the API's few async calls (docs/decisions/one-io-path.md).

Inside a flow, ``answer = yield from Get(job_id)`` is typed: an operation yields itself and returns
what the driver sends back (as asyncio's futures do with ``yield from``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

from omni_jobs.jobs.change import Change, Conflict
from omni_jobs.jobs.models import Job
from omni_jobs.jobs.store import IdempotencyRecord, JobStore

T = TypeVar("T")
R = TypeVar("R")


class Operation(Generic[T]):
    """One I/O of a flow, answered with a T. ``yield from`` it in a flow."""

    __slots__ = ()

    def __iter__(self) -> Generator[Operation[T], T, T]:
        answer = yield self
        return answer


Flow: TypeAlias = Generator["Operation[Any]", Any, R]
"""A flow that answers an R: it yields operations and receives their answers."""


@dataclass(frozen=True, slots=True)
class Commit(Operation[Conflict | None]):
    """Apply ``change`` if its guards hold (None), else say which did not (JobStore.commit)."""

    change: Change


@dataclass(frozen=True, slots=True)
class CommitPlaced(Operation[tuple[Conflict | None, int | None]]):
    """``Commit``, then ``job``'s queue position after the write, in the same round trip (None when the
    change did not apply or no stage of the job waits): a submit's answer shows it."""

    change: Change
    job: Job


@dataclass(frozen=True, slots=True)
class Get(Operation[Job | None]):
    job_id: str


@dataclass(frozen=True, slots=True)
class Idempotency(Operation[IdempotencyRecord | None]):
    """The record of a tenant's Idempotency-Key, if it is still kept."""

    tenant: str
    key: str


@dataclass(frozen=True, slots=True)
class QueuePosition(Operation[int | None]):
    """1-based place of the job's waiting stage on its queue; None when none waits."""

    job: Job


@dataclass(frozen=True, slots=True)
class Oldest(Operation[float | None]):
    """The lowest score at or after ``since`` in sorted set ``key`` (a rate window's oldest entry)."""

    key: str
    since: float


StoreOperation: TypeAlias = Commit | CommitPlaced | Get | Idempotency | QueuePosition | Oldest
"""What a store's ``run`` and ``arun`` answer."""


@dataclass(frozen=True, slots=True)
class Blocking(Operation[T]):
    """Work that blocks (a file read, a DNS lookup, a sync store's call) but is no store operation:
    ``drive`` calls it, ``adrive`` calls it in a thread, off the event loop."""

    call: Callable[[], T]


def drive(store: JobStore, flow: Flow[R]) -> R:
    """Run ``flow`` on this thread: each operation through ``store.run``."""
    answer: object = None
    error: BaseException | None = None
    while True:
        try:
            op = flow.send(answer) if error is None else flow.throw(error)
        except StopIteration as done:
            result: R = done.value
            return result
        answer = error = None
        try:
            answer = op.call() if isinstance(op, Blocking) else store.run(op)
        except BaseException as exc:  # noqa: BLE001 - the flow's to handle, where it asked for it
            error = exc


async def adrive(store: JobStore, flow: Flow[R]) -> R:
    """Run ``flow`` on the event loop: each operation through ``await store.arun``."""
    answer: object = None
    error: BaseException | None = None
    while True:
        try:
            op = flow.send(answer) if error is None else flow.throw(error)
        except StopIteration as done:
            result: R = done.value
            return result
        answer = error = None
        try:
            answer = await asyncio.to_thread(op.call) if isinstance(op, Blocking) else await store.arun(op)
        except BaseException as exc:  # noqa: BLE001 - the flow's to handle, where it asked for it
            error = exc
