"""The API's request middleware: a request id and job id on every log line, an access log line,
and the HTTP metrics (requests and latency by route template, never by raw path).

Pure ASGI (no BaseHTTPMiddleware), so streamed answers (SSE) pass through untouched and the
context variables set here are the ones the route handlers see.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from omni_jobs.core.logs import bind, job_id_var
from omni_jobs.report import metrics

log = logging.getLogger("omni_jobs.api.access")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JOB_IN_PATH = re.compile(r"/v1/jobs/(job_[A-Za-z0-9]+)")
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
QUIET_PATHS = ("/healthz", "/readyz", "/metrics")
"""Probed every few seconds: logged at DEBUG so they do not drown the access log."""


class ObservabilityMiddleware:
    """Runs around every request, so it reads raw bytes and keeps its metric children: a dict of
    decoded headers and two ``labels()`` lookups per request were ~8% of a submit's CPU."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._children: dict[tuple[object, ...], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        given = ""
        for name, value in scope.get("headers", ()):  # ASGI header names are lower-case bytes
            if name == b"x-request-id":
                given = value.decode("latin-1")
                break
        request_id = given if REQUEST_ID.match(given) else f"{random.getrandbits(64):016x}"  # an id, not a secret
        path = str(scope.get("path", ""))
        match = JOB_IN_PATH.search(path) if "/v1/jobs/" in path else None
        reset = bind(request_id=request_id, job_id=match.group(1) if match else None)
        status = 500
        answered_job: list[str] = []

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                raw = list(message.get("headers", []))
                for key, value in raw:
                    name = key.lower()
                    if name == b"x-omni-job-id":
                        answered_job.append(value.decode("latin-1"))
                    elif name == b"location" and b"/v1/jobs/" in value:
                        answered_job.append(value.decode("latin-1").rsplit("/", 1)[-1])
                raw.append((b"x-request-id", request_id.encode("latin-1")))
                message["headers"] = raw
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            template = str(getattr(route, "path", "")) or "unmatched"
            method = str(scope.get("method", ""))
            elapsed = time.perf_counter() - started
            self._child(metrics.HTTP_REQUESTS, method, template, str(status)).inc()
            self._child(metrics.HTTP_DURATION, method, template).observe(elapsed)
            level = logging.DEBUG if path in QUIET_PATHS and status < 500 else logging.INFO
            if log.isEnabledFor(level):
                unbind_answer = bind(job_id=answered_job[0]) if job_id_var.get() is None and answered_job else None
                log.log(level, "%s %s %d %.1fms", method, path, status, elapsed * 1000,
                        extra={"method": method, "path": path, "route": template, "status": status,
                               "duration_ms": round(elapsed * 1000, 2)})
                if unbind_answer is not None:
                    unbind_answer()
            reset()

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, kept (route templates, methods and codes are few)."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child
