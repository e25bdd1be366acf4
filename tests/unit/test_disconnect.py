"""api.disconnect: a waiting request whose client left cancels its jobs, unless it had an Idempotency-Key."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

from starlette.requests import Request

from api.disconnect import until_closed, while_connected
from omni_jobs.accept.submission import JobSubmitter
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.models import JobStatus
from omni_jobs.pipelines.catalogue import load_catalogue
from tests.own_loop import run_in_own_loop


class Leaves:
    """A request whose client has left."""

    async def is_disconnected(self) -> bool:
        return True


def _ledger_with_job() -> tuple[JobLedger, str]:
    ledger = JobLedger(MemoryJobStore())
    return ledger, JobSubmitter(ledger, load_catalogue()).submit("text-to-text", {"prompt": "x"}).id


async def _settle() -> None:
    for _ in range(50):  # the cancel runs in a task of its own, in a thread
        await asyncio.sleep(0.02)


def _status(ledger: JobLedger, job_id: str) -> JobStatus:
    job = ledger.get(job_id)
    assert job is not None
    return job.status


def test_a_client_that_leaves_cancels_the_job_unless_idempotent() -> None:
    async def run(idempotent: bool) -> JobStatus:
        ledger, job_id = _ledger_with_job()
        never = asyncio.get_running_loop().create_future()
        got = await while_connected(cast(Request, Leaves()), never, ledger, [job_id], idempotent=idempotent)
        assert got is None and never.cancelled()
        await _settle()
        return _status(ledger, job_id)

    assert run_in_own_loop(run(False)) is JobStatus.canceled
    assert run_in_own_loop(run(True)) is JobStatus.queued


def test_a_stream_closed_before_its_end_cancels_the_job() -> None:
    async def chunks() -> AsyncIterator[Any]:
        for i in range(10):
            yield i

    async def run(read_all: bool) -> JobStatus:
        ledger, job_id = _ledger_with_job()
        stream = until_closed(chunks(), ledger, [job_id], idempotent=False)
        if read_all:
            assert [i async for i in stream] == list(range(10))
        else:
            assert await anext(stream) == 0
            await stream.aclose()  # what Starlette's cancel of the body comes to
        await _settle()
        return _status(ledger, job_id)

    assert run_in_own_loop(run(False)) is JobStatus.canceled
    assert run_in_own_loop(run(True)) is JobStatus.queued
