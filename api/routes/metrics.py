"""GET /metrics: the API's Prometheus metrics plus the queue depth and live workers per queue.

Queue depth and workers are read from Redis at scrape time, here only (workers do not serve
them), so summing every target never counts a queue twice.

With OMNI_METRICS_TOKEN set, a scrape must carry it (``Authorization: Bearer <token>``; Prometheus's
``authorization`` setting); without it, /metrics is open and names no tenant (the scheduler's ready
stages are counted per queue, the usage counters per tenant left out). /readyz uses the same token for its
details (api.routes.health).
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, Response, status
from fastapi.concurrency import run_in_threadpool

from api.deps import ApiContext, get_context
from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.checks import required_queues
from omni_jobs.report import metrics

router = APIRouter(tags=["health"])


def scrape_token_given(request: Request, settings: Settings) -> bool:
    """Whether the request carries the scrape token (False where none is set: nobody has it)."""
    token = settings.metrics_token
    if token is None:
        return False
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.get_secret_value().encode())


@router.get("/metrics", summary="Prometheus metrics (text exposition format)", response_class=Response,
            responses={401: {"description": "OMNI_METRICS_TOKEN is set, and the scrape did not carry it."}})
async def prometheus_metrics(ctx: Annotated[ApiContext, Depends(get_context)], request: Request) -> Response:
    rt = ctx.runtime
    authorized = scrape_token_given(request, rt.settings)
    if rt.settings.metrics_token is not None and not authorized:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
                            detail="/metrics needs the scrape token (OMNI_METRICS_TOKEN): "
                                   "Authorization: Bearer <token>")
    queues = metrics.QueueCollector(rt.broker_redis, rt.redis, lambda: required_queues(rt.catalogue, rt.settings),
                                    counts=rt.store.queue_counts, tenants=authorized)
    body, content_type = await run_in_threadpool(lambda: metrics.render(queues, tenants=authorized))
    return Response(body, media_type=content_type)
