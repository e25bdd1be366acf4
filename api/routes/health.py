"""Liveness and readiness for load balancers and compose healthchecks."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Response, status

from api.deps import ApiContext, get_context

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The process is up")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Redis is reachable")
def readyz(ctx: Annotated[ApiContext, Depends(get_context)], response: Response) -> dict[str, Any]:
    try:
        ctx.runtime.redis.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return {"status": "unavailable", "redis": str(exc)}
    return {"status": "ok", "redis": "ok"}
