"""Liveness and readiness for load balancers and compose healthchecks.

``/healthz``: the process answers. ``/readyz``: it can take jobs that will run, meaning Redis,
the broker and the artifact store answer and every queue the catalogue needs (each stage's queue
and ``results``; ``webhooks`` when a signing secret is set) has at least one live worker. A 503
lists what is missing and how to fix it.

Both are open (probes carry no credentials). /readyz names hosts only to a request that carries the
scrape token (OMNI_METRICS_TOKEN): the workers' names (``dit@host``) and the services' addresses and
errors. Without it, the same verdict, each worker list a count and each failure its fix.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response, status

from api.deps import ApiContext, get_context
from api.routes.metrics import scrape_token_given
from omni_jobs.artifacts.backends import ArtifactBackend
from omni_jobs.dispatch.checks import (
    Check,
    check_artifact_store,
    check_redis,
    check_workers,
    describe_backend,
    probe_backend,
    required_queues,
)

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The process is up")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


def _probe(request: Request, ctx: ApiContext) -> ArtifactBackend:
    """A fast-failing artifact backend, made once per process (a boto3 client costs ~50 ms)."""
    backend: ArtifactBackend | None = getattr(request.app.state, "readiness_probe", None)
    if backend is None:
        backend = probe_backend(ctx.runtime.settings)
        request.app.state.readiness_probe = backend
    return backend


NO_WORKER = "no live worker"


def _detail(check: Check, detailed: bool) -> str:
    """What a failed check found; without the scrape token only whether it failed: a detail names the
    server (a Redis URL, an S3 endpoint, a directory) and carries its error's text."""
    if detailed or check.detail == NO_WORKER:
        return check.detail
    return "unavailable"


@router.get("/readyz", summary="Redis, the artifact store and a worker per needed queue are reachable",
            responses={503: {"description": "Not ready: `missing` says what and how to fix it."}})
def readyz(ctx: Annotated[ApiContext, Depends(get_context)], request: Request, response: Response,
           workers_required: Annotated[bool, Query(alias="workers", description=(
               "false: a queue with no live worker does not make the API unready (still listed). For "
               "deployments that scale stage workers to zero: jobs must reach the API to wake them."))] = True,
           ) -> dict[str, Any]:
    rt = ctx.runtime
    settings = rt.settings
    checks: list[Check] = [check_redis(rt.redis, url=settings.redis_url, wait_aof=settings.redis_wait_aof)]
    if settings.effective_broker_url != settings.redis_url:
        checks.append(check_redis(rt.broker_redis, name="broker", url=settings.effective_broker_url))
    checks.append(check_artifact_store(_probe(request, ctx), where=describe_backend(settings)))
    workers: dict[str, list[str]] = {}
    if checks[0].ok:
        for check in check_workers(rt.redis, required_queues(rt.catalogue, settings)):
            checks.append(check)
            workers[check.name] = check.detail.split(", ") if check.ok else []
    detailed = scrape_token_given(request, settings)
    missing = [f"{c.section}/{c.name}: {_detail(c, detailed)}" + (f" -> {c.fix}" if c.fix else "") for c in checks
               if not c.ok and (workers_required or c.section != "workers")]
    body: dict[str, Any] = {
        "status": "ok" if not missing else "unavailable",
        "redis": "ok" if checks[0].ok else _detail(checks[0], detailed),
        "artifact_store": next(("ok" if c.ok else _detail(c, detailed)) for c in checks if c.name == "artifact store"),
        "workers": workers if detailed else {queue: len(names) for queue, names in workers.items()},
        "missing": missing,
    }
    if missing:
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        response.headers["Retry-After"] = "5"
    return body
