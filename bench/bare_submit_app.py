"""The bare-stack baseline of bench.submit: what FastAPI + redis.asyncio cost with nothing else.

    BARE_REDIS_URL=redis://... uvicorn bench.bare_submit_app:app

POST /v1/jobs takes the same body as the real route (a pydantic model with the same fields) and
stores it with one SET of the job and one LPUSH of its id, in one MULTI: the least a durable
accept can do. No auth, no validation against a pipeline, no scheduling.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import redis.asyncio as aioredis
from fastapi import FastAPI, status
from pydantic import BaseModel, ConfigDict


class BareJobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pipeline: str
    input: dict[str, Any]
    params: dict[str, dict[str, Any]] | None = None
    webhook: str | None = None
    priority: Literal["low", "normal", "high"] = "normal"
    webhook_events_filter: list[Literal["start", "progress", "completed"]] | None = None


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.redis = aioredis.Redis.from_url(os.environ.get("BARE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    yield
    await app.state.redis.aclose()


app = FastAPI(lifespan=_lifespan)
WAIT_AOF = os.environ.get("BARE_WAIT_AOF") == "1"


@app.post("/v1/jobs", status_code=status.HTTP_202_ACCEPTED)
async def create_job(body: BareJobRequest) -> dict[str, Any]:
    job_id = f"job_{secrets.token_hex(16)}"
    client: aioredis.Redis = app.state.redis
    async with client.pipeline(transaction=True) as pipe:
        pipe.set(f"bare:job:{job_id}", body.model_dump_json())
        pipe.lpush("bare:queue", job_id)
        await pipe.execute()
    if WAIT_AOF:  # the waitaof row: answered once the AOF has it on disk, as the system's submit
        await client.execute_command("WAITAOF", 1, 0, 1000)
    return {"id": job_id, "status": "queued", "created_at": time.time()}


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}
