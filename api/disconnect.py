"""A client that leaves while its request waits on jobs (an OpenAI route, ``Prefer: wait``): the jobs are
canceled, unless the request carried an Idempotency-Key.

Without a key nobody can find those jobs again: the answer was theirs only, and OpenAI's SDKs retry a
dropped request by submitting it again, so the first jobs would run (and be charged) for nobody. With a
key a retry answers the same jobs, so they keep running. The cancel is the ledger's, as POST
/v1/jobs/{id}/cancel does it (omni_jobs.dispatch.cancellation): the workers stop at their next step.

A plain answer learns of the leaving by polling ``request.is_disconnected()`` while it waits (the body
was read, so the next ASGI message is the disconnect); a streamed one when Starlette cancels its body
(the generator is closed before its end). Either way the cancel runs in a task of its own: the request's
own task may already be canceled, and its awaits would be too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from starlette.requests import Request

from omni_jobs.core.errors import JobAlreadyFinished, JobNotFound
from omni_jobs.dispatch.cancellation import cancel_job
from omni_jobs.jobs.ledger import JobLedger

log = logging.getLogger(__name__)

T = TypeVar("T")
POLL_S = 0.25
"""How often a waiting request looks whether its client is still there."""
REASON = "the client disconnected before its answer (no Idempotency-Key, so a retry would start it again)"
_CANCELING: set[asyncio.Task[None]] = set()
"""Cancels under way (kept so that they are not collected before they ran)."""


async def _cancel_all(ledger: JobLedger, job_ids: Sequence[str]) -> None:
    for job_id in job_ids:
        try:
            await asyncio.to_thread(cancel_job, ledger, job_id, REASON)
        except (JobAlreadyFinished, JobNotFound):
            continue  # it ended meanwhile: nothing to stop
        except Exception:
            log.exception("job %s: its client left, and the job could not be canceled", job_id)
        else:
            log.info("job %s canceled: %s", job_id, REASON)


def abandon(ledger: JobLedger, job_ids: Sequence[str], *, idempotent: bool) -> None:
    """Cancel the jobs of a request whose client left (in a task of its own), unless ``idempotent``."""
    if idempotent or not job_ids:
        return
    task = asyncio.get_running_loop().create_task(_cancel_all(ledger, list(job_ids)))
    _CANCELING.add(task)
    task.add_done_callback(_CANCELING.discard)


async def while_connected(request: Request, waiting: Awaitable[T], ledger: JobLedger, job_ids: Sequence[str], *,
                          idempotent: bool) -> T | None:
    """``waiting``'s result; None once the client left, its jobs then canceled (``abandon``). A request
    whose own task is canceled abandons them too."""
    task = asyncio.ensure_future(waiting)
    try:
        while True:
            done, _pending = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                abandon(ledger, job_ids, idempotent=idempotent)
                return None
    except asyncio.CancelledError:
        task.cancel()
        abandon(ledger, job_ids, idempotent=idempotent)
        raise


async def until_closed(stream: AsyncIterator[T], ledger: JobLedger, job_ids: Sequence[str], *,
                       idempotent: bool) -> AsyncGenerator[T, None]:
    """``stream``, whose jobs are abandoned if it is closed before its end (Starlette cancels a streamed
    body when its client disconnects)."""
    ended = False
    try:
        async for item in stream:
            yield item
        ended = True
    finally:
        if not ended:
            abandon(ledger, job_ids, idempotent=idempotent)
