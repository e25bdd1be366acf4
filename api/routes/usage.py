"""GET /v1/usage: what each tenant used, by UTC day (omni_jobs.report.usage); HTTP only.

A key sees its own tenant's usage; a key of one of OMNI_ADMIN_TENANTS sees every tenant's, or one
(``tenant=``). Errors in OpenAI's shape, as the other OpenAI-style routes.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool

from api.auth import authenticate
from api.deps import get_context
from api.routes.openai import OpenAIErrorBody
from api.schemas import errors
from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.core.json_types import JsonObject
from omni_jobs.report.usage import DAY_S, flush_pending, read_usage

MAX_TIME = 10**11
"""Unix seconds far beyond any date a job has (the year 5138)."""

router = APIRouter(prefix="/v1", tags=["usage"], responses=errors(401, 503))


def install(app: FastAPI) -> None:
    app.include_router(router, dependencies=[Depends(authenticate)])


@router.get("/usage", summary="Usage per tenant by day: jobs by status, stage-seconds per queue, tokens, images, "
            "audio seconds, video frames",
            responses={400: {"model": OpenAIErrorBody, "description": "end is not after start, or more than 366 days "
                             "after it (param: end)."},
                       403: {"model": OpenAIErrorBody, "description": "tenant= names another tenant, and this key is "
                             "not an admin's (OMNI_ADMIN_TENANTS)."}})
async def get_usage(
    request: Request,
    start: Annotated[int, Query(ge=0, le=MAX_TIME, description="Unix seconds (UTC): the first day's bucket holds it.")],
    end: Annotated[int | None, Query(ge=0, le=MAX_TIME, description="Unix seconds, exclusive; default: now. "
                                     "After start, at most 366 days later.")] = None,
    bucket: Literal["day", "1d"] = "day",
    tenant: Annotated[str | None, Query(max_length=200, description="Admins: one tenant only.")] = None,
) -> JsonObject:
    ctx = get_context(request)
    own = str(request.state.tenant)
    admin = own in ctx.runtime.settings.admin_tenants
    if tenant is not None and tenant != own and not admin:
        raise OpenAIError(403, f"this key sees tenant {own!r}'s usage only; an admin's key (OMNI_ADMIN_TENANTS) sees "
                          "others'", param="tenant", code="forbidden", type_="permission_error")
    end_s = float(end) if end is not None else max(time.time(), start + DAY_S)
    tenants = [tenant] if tenant is not None else (None if admin else [own])
    try:
        await run_in_threadpool(flush_pending)  # this process's last commits too
        page: dict[str, Any] = await run_in_threadpool(read_usage, ctx.runtime.redis, tenants=tenants,
                                                       start=float(start), end=end_s)
    except ValueError as exc:  # end before start, or more than 366 days
        raise OpenAIError(400, str(exc), param="end") from None
    return page
