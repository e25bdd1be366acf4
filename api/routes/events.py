"""GET /v1/jobs/{id}/events: the job's events as Server-Sent Events, until the job ends.

Each message is ``id: <stream id>``, ``event: <type>`` (job.queued, stage.started, stage.progress,
output.delta, job.succeeded, ...) and ``data: <the event as JSON>``; the final event's data also
carries the finished ``job`` object. Partial outputs are events like the others: an AR stage's text
as it is generated (``output.delta``: ``{stage, output, text, index, attempt}``) is in the stream, so
a client that reconnects with ``Last-Event-ID`` (or ``?after=``) gets what it missed, deltas
included, and no more; without one it gets the whole history first. Comment lines keep an
idle connection open through proxies. The stream closes after the job's final event.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import StreamingResponse

from api.auth import Tenant, authenticate
from api.deps import ApiContext, get_context
from api.schemas import errors
from omni_jobs.core.errors import FieldError, InvalidRequest, JobNotFound
from omni_jobs.jobs.models import FINAL_EVENTS

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(authenticate)], responses=errors(401, 503))
Ctx = Annotated[ApiContext, Depends(get_context)]

EVENT_ID = r"^[0-9]{1,19}-[0-9]{1,19}$"
"""A Redis stream id (ms-seq), in the spec and checked here (422). Nineteen digits each, not
watch.STREAM_ID's twenty: a twenty-digit part can pass 2**64 - 1, which Redis refuses in the middle
of the stream (the answer was cut short); this server's ids have thirteen."""
_EVENT_ID = re.compile(EVENT_ID.removeprefix("^").removesuffix("$"))  # fullmatch: no "$" before a newline
HEADER_EVENT_ID = rf"^(?={EVENT_ID.removeprefix('^')})[0-9-]+$"
"""EVENT_ID, spelled for the header's schema with a lookahead: schemathesis (4.32) makes no valid value
for a header whose pattern needs a character other than a letter or digit (the '-'), and then sends
an invalid one as a valid case. The same strings match; pydantic's regex engine takes no lookahead,
so _start_after checks both parameters."""
EXAMPLE_ID = "1712345678901-0"
HEARTBEAT_S = 15.0
RECONNECT_MS = 2000


def _start_after(last_event_id: str | None, after: str | None) -> str:
    """Where the stream starts: Last-Event-ID (a reconnecting browser sends it), else ``after``; each
    one given must be an event id."""
    given = {("header", "Last-Event-ID"): last_event_id, ("query", "after"): after}
    errors = [FieldError(loc, f"{value!r} is not an event id (like '{EXAMPLE_ID}'); send back an id this stream "
                              "gave you", "string_pattern_mismatch")
              for loc, value in given.items() if value is not None and not _EVENT_ID.fullmatch(value)]
    if errors:
        raise InvalidRequest(errors)
    return last_event_id or after or "0-0"


@router.get(
    "/{job_id}/events",
    summary="Stream the job's events (Server-Sent Events) until it ends",
    response_class=StreamingResponse,
    responses={200: {"description": "`retry:`, then `id:`/`event:`/`data:` messages (each event as JSON; the final "
                     "one's data adds `job`, the JobView) and `: keep-alive` comments, until the job ends.",
                     "content": {"text/event-stream": {}}},
               **errors(404, 422, 429, e422="Last-Event-ID or `after` is not an event id this stream gave.",
                        e429="The tenant holds OMNI_MAX_STREAMS_PER_TENANT streams open already.")},
)
async def job_events(
    job_id: str,
    ctx: Ctx,
    tenant: Tenant,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=64, examples=[EXAMPLE_ID],
                                                json_schema_extra={"pattern": HEADER_EVENT_ID})] = None,
    after: Annotated[str | None, Query(max_length=64, examples=[EXAMPLE_ID], json_schema_extra={"pattern": EVENT_ID},
                                       description=f"Resume after this event id (like {EXAMPLE_ID}).")] = None,
) -> StreamingResponse:
    start = _start_after(last_event_id, after)
    watcher = ctx.watcher
    owner = await watcher.get(job_id)
    if owner is None or owner.tenant != tenant:  # another tenant's job: 404, as if unknown
        raise JobNotFound(job_id)
    slot = ctx.streams.take(tenant)  # 429 past the tenant's streams, 503 past the process's (api.streams)

    async def stream() -> AsyncIterator[str]:
        yield f"retry: {RECONNECT_MS}\n\n"
        async for event in watcher.follow(job_id, after=start, heartbeat_s=HEARTBEAT_S):
            if event is None:
                yield ": keep-alive\n\n"
                continue
            payload = event.model_dump(mode="json")
            if event.type in FINAL_EVENTS:
                job = await watcher.get(job_id)
                payload["job"] = ctx.runtime.present(job) if job is not None else None
            yield f"id: {event.id}\nevent: {event.type}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    return StreamingResponse(
        slot.guard(stream()),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
