"""The FastAPI application: routes over omni_jobs, and errors mapped to clear HTTP answers.

Run with ``uvicorn api.main:app``; tests call ``create_app(settings)``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from api.deps import ApiContext
from api.routes import health, jobs, pipelines
from omni_jobs.artifacts import ArtifactStoreUnavailable
from omni_jobs.errors import InvalidRequest, JobAlreadyFinished, JobNotFound, UnknownPipeline
from omni_jobs.runtime import Runtime
from omni_jobs.settings import Settings, get_settings

log = logging.getLogger(__name__)


def _invalid_request(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidRequest)
    detail = [{"loc": ["body", *e.loc], "msg": e.message, "type": e.type} for e in exc.errors]
    return JSONResponse({"detail": detail}, status_code=422)


def _unknown_pipeline(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, UnknownPipeline)
    detail = [{"loc": ["body", "pipeline"], "msg": str(exc), "type": "unknown_pipeline"}]
    return JSONResponse({"detail": detail}, status_code=422)


def _not_found(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=404)


def _conflict(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=409)


def _unavailable(_: Request, exc: Exception) -> JSONResponse:
    log.warning("backing service unavailable: %s", exc)
    return JSONResponse(
        {"detail": "a backing service (Redis or the artifact store) is unavailable; retry shortly"},
        status_code=503,
        headers={"Retry-After": "5"},
    )


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx = ApiContext(Runtime(settings))
        ctx.runtime.catalogue.names()  # load and validate pipelines at start: a bad YAML stops the API here
        app.state.ctx = ctx
        yield
        ctx.close()

    app = FastAPI(
        title="omni-jobs",
        version="0.1.0",
        description="Multi-stage multimodal generation (vLLM AR + diffusers DiT) as durable asynchronous jobs.",
        lifespan=lifespan,
    )
    app.include_router(health.router)
    app.include_router(pipelines.router)
    app.include_router(jobs.router)
    app.add_exception_handler(InvalidRequest, _invalid_request)
    app.add_exception_handler(UnknownPipeline, _unknown_pipeline)
    app.add_exception_handler(JobNotFound, _not_found)
    app.add_exception_handler(JobAlreadyFinished, _conflict)
    app.add_exception_handler(ArtifactStoreUnavailable, _unavailable)
    app.add_exception_handler(redis.ConnectionError, _unavailable)
    return app


app = create_app()
