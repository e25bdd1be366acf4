"""GET /metrics: the API's Prometheus metrics plus the queue depth and live workers per queue.

Queue depth and workers are read from Redis at scrape time, here only (workers do not serve
them), so summing every target never counts a queue twice.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response
from fastapi.concurrency import run_in_threadpool

from api.deps import ApiContext, get_context
from omni_jobs import metrics
from omni_jobs.checks import required_queues

router = APIRouter(tags=["health"])


@router.get("/metrics", summary="Prometheus metrics (text exposition format)", response_class=Response)
async def prometheus_metrics(ctx: Annotated[ApiContext, Depends(get_context)]) -> Response:
    rt = ctx.runtime
    queues = metrics.QueueCollector(rt.broker_redis, rt.redis, lambda: required_queues(rt.catalogue, rt.settings),
                                    counts=rt.store.queue_counts)
    body, content_type = await run_in_threadpool(metrics.render, queues)
    return Response(body, media_type=content_type)
