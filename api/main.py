"""The FastAPI application: routes over omni_jobs, and errors mapped to clear HTTP answers.

Run with ``uvicorn api.main:app``; tests call ``create_app(settings)``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from api import body_limit, docs, uploads
from api.deps import ApiContext
from api.observability import ObservabilityMiddleware
from api.responses import JSONText
from api.routes import batches, events, health, jobs, metrics, openai, pipelines, usage
from api.schemas import JobRequest, job_request_schemas
from api.ui import router as ui_router
from omni_jobs.accept import openai_audio, openai_schema
from omni_jobs.artifacts import ArtifactStoreUnavailable
from omni_jobs.core.collector import set_young_threshold
from omni_jobs.core.errors import (
    IdempotencyConflict,
    InvalidRequest,
    JobAlreadyFinished,
    JobNotFound,
    NotDurable,
    Overloaded,
    QuotaExceeded,
    UnknownPipeline,
)
from omni_jobs.core.logs import configure_logging
from omni_jobs.core.settings import Settings, get_settings
from omni_jobs.pipelines.catalogue import PipelineCatalogue, load_catalogue
from omni_jobs.pipelines.limits import Limits
from omni_jobs.pipelines.model_source import load_model_sources
from omni_jobs.report import usage as usage_counts
from omni_jobs.report.metrics import QUOTA_REFUSALS
from omni_jobs.report.metrics import install as install_metrics
from omni_jobs.runtime import Runtime

log = logging.getLogger(__name__)


def _invalid_request(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidRequest)
    detail = [
        {"loc": list(e.loc) if e.loc[0] in ("header", "query", "path") else ["body", *e.loc],
         "msg": e.message, "type": e.type}
        for e in exc.errors
    ]
    return JSONResponse({"detail": detail}, status_code=422)


def _unknown_pipeline(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, UnknownPipeline)
    detail = [{"loc": ["body", "pipeline"], "msg": str(exc), "type": "unknown_pipeline"}]
    return JSONResponse({"detail": detail}, status_code=422)


def _not_found(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=404)


def _conflict(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=409)


def _overloaded(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Overloaded)
    return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": str(exc.retry_after_s)})


def _quota_exceeded(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, QuotaExceeded)
    QUOTA_REFUSALS.labels(exc.limit).inc()
    return JSONResponse({"detail": str(exc), "limit": exc.limit, "value": exc.value}, status_code=429,
                        headers={"Retry-After": str(max(1, round(exc.retry_after_s)))})


def _unavailable(_: Request, exc: Exception) -> JSONResponse:
    log.warning("backing service unavailable: %s", exc)
    return JSONResponse(
        {"detail": "a backing service (Redis or the artifact store) is unavailable; retry shortly"},
        status_code=503,
        headers={"Retry-After": "5"},
    )


def _not_nullable(parameter: dict[str, Any]) -> None:
    """A query or header parameter is absent or a string, never null (there is no null on the wire):
    FastAPI writes ``X | None = None`` as anyOf [X, null], so a client (or a fuzzer) sends "null"."""
    schema = parameter.get("schema", {})
    options = schema.get("anyOf")
    if options and {"type": "null"} in options:
        kept = [o for o in options if o != {"type": "null"}]
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        parameter["schema"] = {**rest, **kept[0]} if len(kept) == 1 else {**rest, "anyOf": kept}


def _not_nullable_parameters(schema: dict[str, Any]) -> None:
    for item in schema.get("paths", {}).values():
        for operation in item.values():
            for parameter in operation.get("parameters", []):
                if parameter.get("in") in ("query", "header"):
                    _not_nullable(parameter)


def _describe_pipelines(schema: dict[str, Any], catalogue: PipelineCatalogue, settings: Settings) -> None:
    """What each pipeline takes, where the spec takes a pipeline: POST /v1/jobs's body is a oneOf on
    ``pipeline`` (api.schemas.job_request_schemas), the multipart form too (api.uploads.request_body),
    and a pipeline name in a path is one of the catalogue's (else 404). Built from the catalogue the
    app runs with (built-in and OMNI_PIPELINES_PATH pipelines, loaded once per process) and the
    settings that limit a request, so the spec holds for the life of the process."""
    limits, webhooks = Limits.from_settings(settings), settings.webhook_secret is not None
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    # POST /v1/jobs reads its own body (api.json_body), so FastAPI does not list its model
    base = components.get("JobRequest") or JobRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    bodies = job_request_schemas(base, catalogue, limits, webhooks=webhooks)
    components.update(bodies)
    branches = {name.removeprefix("JobRequest."): body for name, body in bodies.items() if name != "JobRequest"}
    paths = schema.get("paths", {})
    paths["/v1/jobs/multipart"]["post"]["requestBody"] = uploads.request_body(branches, catalogue, limits,
                                                                               webhooks=webhooks)
    for parameter in paths["/v1/pipelines/{name}"]["get"].get("parameters", []):
        if parameter.get("name") == "name":
            parameter["schema"]["enum"] = catalogue.names()
    for name in openai_schema.ENDPOINTS:  # the OpenAI bodies: one route per pipeline they can run
        components[name] = openai_schema.request_schema(name, components[name], catalogue, limits,
                                                        settings.openai_model_aliases)
    for path in openai.TRANSCRIPTION_PATHS:  # their form: one branch per speech pipeline
        paths[path]["post"]["requestBody"] = openai_audio.form_body(catalogue, limits, settings.openai_model_aliases)


def _setting_limits(schema: dict[str, Any], settings: Settings) -> None:
    """Limits that are settings, fixed for the life of the process: in the spec as they are in force."""
    n = schema.get("components", {}).get("schemas", {}).get("ImageGenerationRequest", {}).get("properties", {}).get("n")
    if n is not None:
        n["maximum"] = min(n.get("maximum", settings.max_outputs), settings.max_outputs)
    for path in ("/v1/jobs", "/v1/jobs/multipart"):
        for parameter in schema["paths"][path]["post"]["parameters"]:
            if parameter["name"] == "cancel-after":
                parameter["schema"]["pattern"] = jobs.cancel_after_pattern(settings.max_cancel_after_s)


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """The spec FastAPI generates, made to say what the API enforces (see the functions above)."""

    generate = app.openapi  # FastAPI's: it caches its result in app.openapi_schema, patched here once

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            ctx = getattr(app.state, "ctx", None)  # the running app's catalogue; without lifespan, the same files
            catalogue = ctx.runtime.catalogue if ctx is not None else load_catalogue(settings.pipelines_path)
            _not_nullable_parameters(schema)
            _setting_limits(schema, settings)
            _describe_pipelines(schema, catalogue, settings)
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    install_metrics()  # the core's telemetry (batches, caches, artifact bytes, job events) as Prometheus metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        configure_logging(settings.log_format, settings.log_level, service="api")  # JSON lines with job ids
        set_young_threshold(settings.api_gc_young_threshold)  # the collector took ~6% of a submit (omni_jobs.core.collector)
        load_model_sources(settings.model_sources)  # tiny:NAME ids (validation knows their sizes)
        ctx = ApiContext(Runtime(settings, worker="api"))
        usage_counts.install(ctx.runtime.redis)  # usage per tenant: the jobs this process makes and cancels
        ctx.runtime.catalogue.names()  # load and validate pipelines at start: a bad YAML stops the API here
        ctx.start()  # the outbox relay: what was accepted before a crash is published now
        if not settings.auth_enabled:
            log.warning("AUTHENTICATION IS OFF (OMNI_AUTH_ENABLED=false): anyone who reaches this API can submit, "
                        "read and cancel every job. Only for a local demo; never expose this port.")
        app.state.ctx = ctx
        try:
            yield
        finally:  # also when the lifespan is cancelled: a relay left running would publish this Redis's outbox
            await ctx.aclose()

    app = FastAPI(
        title="omni-jobs",
        version="0.1.0",
        description="Multi-stage multimodal generation (vLLM AR + diffusers DiT) as durable asynchronous jobs.",
        lifespan=lifespan,
        docs_url=None,  # /docs and /redoc come from api.docs, with their assets served here (no CDN)
        redoc_url=None,
        default_response_class=JSONText,  # orjson (api.responses)
    )
    docs.install(app)
    install_openapi(app, settings)
    app.include_router(health.router)
    app.include_router(pipelines.router)
    app.include_router(jobs.router)
    app.include_router(events.router)
    app.include_router(metrics.router)
    app.include_router(ui_router)  # the web console under /ui (server-rendered pages over the same core)
    openai.install(app)  # /v1/chat/completions, /v1/images/generations, /v1/audio/*, /v1/models
    batches.install(app)  # /v1/files, /v1/batches (OpenAI's Batch API)
    usage.install(app)  # /v1/usage
    app.add_middleware(ObservabilityMiddleware)  # request id, job id in logs, access log, HTTP metrics
    body_limit.install(app, settings.max_request_bytes)  # outermost: 413 before a large body is read
    app.add_exception_handler(InvalidRequest, _invalid_request)
    app.add_exception_handler(UnknownPipeline, _unknown_pipeline)
    app.add_exception_handler(JobNotFound, _not_found)
    app.add_exception_handler(JobAlreadyFinished, _conflict)
    app.add_exception_handler(IdempotencyConflict, _conflict)
    app.add_exception_handler(Overloaded, _overloaded)
    app.add_exception_handler(QuotaExceeded, _quota_exceeded)
    app.add_exception_handler(ArtifactStoreUnavailable, _unavailable)
    app.add_exception_handler(NotDurable, _unavailable)
    app.add_exception_handler(redis.ConnectionError, _unavailable)
    app.add_exception_handler(redis.TimeoutError, _unavailable)  # a primary that answers nothing (failover)
    return app


app = create_app()
