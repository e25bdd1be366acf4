"""The console's pages and streams under /ui, over the same core calls as the JSON API.

Pages are rendered on the server; console.js only follows the live streams (Server-Sent Events)
and swaps in the parts of a page the server re-rendered. Without JavaScript every page and form
still works (submitting, cancelling, paging); only the live updates need it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from importlib import resources
from typing import Annotated, Any
from urllib.parse import urlencode

import redis
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse, StreamingResponse
from fastapi.routing import APIRoute

from api.deps import ApiContext, get_context
from api.ui import forms, graph, session, templating, views
from omni_jobs.artifacts import ArtifactCorrupted, ArtifactNotFound, ArtifactStoreUnavailable
from omni_jobs.core.errors import (
    IdempotencyConflict,
    InvalidRequest,
    JobAlreadyFinished,
    JobNotFound,
    Overloaded,
    QuotaExceeded,
    UnknownPipeline,
)
from omni_jobs.dispatch.cancellation import cancel_job
from omni_jobs.jobs.models import FINAL_EVENTS, JobStatus
from omni_jobs.jobs.watch import STREAM_ID
from omni_jobs.report.metrics import QUOTA_REFUSALS
from omni_jobs.report.usage import DAY_S, flush_pending, read_usage

log = logging.getLogger(__name__)

PAGE_SIZES = (10, 25, 50, 100)
DEFAULT_PAGE_SIZE = 25
MAX_SCAN = 1000
"""A pipeline filter reads at most this many jobs per page before it shows what it found (and a link on)."""
LIST_POLL_S = 1.0
LIST_REVERIFY_S = 30.0
JOB_HEARTBEAT_S = 1.0
RENDER_EVERY_S = 0.25
KEEPALIVE_S = 15.0
WEBHOOK_TAIL_S = 600.0
"""The longest a job page follows its webhooks after the job ends (a message retried for hours is shown
as it stands then); it stops as soon as none of them is queued or being sent."""
WEBHOOK_POLL_S = 1.0
LIVE_OUTPUT_EVENTS = ("output.delta", "output.preview")
"""Streaming partial outputs (text deltas, DiT previews): forwarded to the page as they come."""


def _wants_html(request: Request) -> bool:
    return request.method == "GET" and "text/html" in request.headers.get("accept", "")


class ConsoleRoute(APIRoute):
    """Errors as pages: sign-in redirects, 403/404/409/503 in the console's look, never JSON."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except session.NotSignedIn:
                if _wants_html(request):
                    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                    return RedirectResponse(f"/ui/login?{urlencode({'next': target})}", status_code=303)
                return Response("sign in at /ui/login", status_code=401, media_type="text/plain")
            except session.CsrfFailed:
                return templating.render(request, "error.html", status_code=403, title="Form expired",
                                         viewer=getattr(request.state, "viewer", None),
                                         message="This form was not accepted (its security token is missing or "
                                                 "stale, or it came from another site). Go back, reload the page "
                                                 "and try again.")
            except (JobNotFound, UnknownPipeline) as exc:
                return templating.render(request, "error.html", status_code=404, title="Not found",
                                         message=str(exc), viewer=getattr(request.state, "viewer", None))
            except ArtifactCorrupted as exc:  # a stored file that is not what its job recorded: never a 500
                log.error("console: %s", exc)
                return templating.render(request, "error.html", status_code=502, title="File damaged",
                                         message="This file's stored bytes do not match what the job recorded "
                                                 "(it was changed outside omni-jobs).",
                                         viewer=getattr(request.state, "viewer", None))
            except (redis.ConnectionError, ArtifactStoreUnavailable) as exc:
                log.warning("console: backing service unavailable: %s", exc)
                response = templating.render(request, "error.html", status_code=503, title="Unavailable",
                                             message="Redis or the artifact store is not answering; retry shortly.",
                                             viewer=getattr(request.state, "viewer", None))
                response.headers["Retry-After"] = "5"
                return response

        return route


router = APIRouter(prefix="/ui", include_in_schema=False, route_class=ConsoleRoute)
Ctx = Annotated[ApiContext, Depends(get_context)]


def get_viewer(request: Request, ctx: Ctx) -> session.Viewer:
    who = session.viewer(request, ctx)
    request.state.viewer = who
    return who


Viewer = Annotated[session.Viewer, Depends(get_viewer)]


# --- static files (from the installed package; cache-busted by content hash) ---
STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".svg": "image/svg+xml", ".png": "image/png", ".txt": "text/plain; charset=utf-8"}


def _load_static() -> dict[str, tuple[bytes, str, str]]:
    files: dict[str, tuple[bytes, str, str]] = {}
    for entry in resources.files("api.ui").joinpath("static").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in STATIC_TYPES:
            data = entry.read_bytes()
            files[entry.name] = (data, STATIC_TYPES[suffix], hashlib.sha256(data).hexdigest()[:12])
    return files


STATIC = _load_static()
templating.env.globals["static_url"] = lambda name: f"/ui/static/{name}?v={STATIC[name][2]}"


@router.get("/static/{name}")
def static(name: str, request: Request) -> Response:
    found = STATIC.get(name)
    if found is None:
        return Response("not found", status_code=404, media_type="text/plain")
    data, media_type, digest = found
    etag = f'"{digest}"'
    headers = {"ETag": etag, "Cache-Control": "public, max-age=31536000, immutable",
               "X-Content-Type-Options": "nosniff"}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    return Response(data, media_type=media_type, headers=headers)


# --- sign-in ---
@router.get("")
@router.get("/")
def index() -> Response:
    return RedirectResponse("/ui/jobs", status_code=303)


@router.get("/login")
def login_page(request: Request, ctx: Ctx, next: str | None = None) -> Response:
    try:
        session.viewer(request, ctx)
        return RedirectResponse(session.safe_next(next), status_code=303)
    except session.NotSignedIn:
        pass
    return templating.render(request, "login.html", next=session.safe_next(next), error=None)


@router.post("/login")
async def login(request: Request, ctx: Ctx) -> Response:
    form = await request.form()
    session.check_csrf(request, form.get(session.CSRF_FIELD))
    target = session.safe_next(str(form.get("next") or ""))
    if not ctx.runtime.settings.auth_enabled:
        return RedirectResponse(target, status_code=303)
    key = form.get("api_key")
    key = key.strip() if isinstance(key, str) else ""
    info = await run_in_threadpool(session.key_of, ctx, key) if key else None
    if info is None:
        return templating.render(request, "login.html", status_code=401, next=target,
                                 error="That API key was not accepted: it is unknown, revoked or mistyped."
                                 if key else "Paste an API key (omni-jobs keys create --tenant NAME prints one).")
    response = RedirectResponse(target, status_code=303)
    await run_in_threadpool(session.start_session, request, response, ctx, info)
    return response


@router.post("/logout")
async def logout(request: Request, ctx: Ctx) -> Response:
    form = await request.form()
    session.check_csrf(request, form.get(session.CSRF_FIELD))
    response = RedirectResponse("/ui/login?signed_out=1", status_code=303)
    await run_in_threadpool(session.end_session, request, response, ctx)
    return response


# --- jobs list ---
def _status_filter(status: str | None) -> JobStatus | None:
    try:
        return JobStatus(status) if status else None
    except ValueError:
        return None


def list_jobs(ctx: ApiContext, tenant: str, *, status: JobStatus | None, pipeline: str | None,
              cursor: str | None, limit: int) -> tuple[list[dict[str, Any]], str | None]:
    """Newest first, the tenant's own; the pipeline filter reads on through the core's pages."""
    jobs: list[dict[str, Any]] = []
    scanned = 0
    while True:
        page = ctx.runtime.jobs.page(limit=limit - len(jobs), cursor=cursor, status=status, tenant=tenant)
        scanned += len(page.jobs)
        jobs.extend(ctx.runtime.present(j) for j in page.jobs if pipeline is None or j.pipeline == pipeline)
        cursor = page.next_cursor
        if len(jobs) >= limit or cursor is None or scanned >= MAX_SCAN:
            return jobs, cursor


def _list_query(status: str | None, pipeline: str | None, limit: int, cursor: str | None = None) -> str:
    params = {k: v for k, v in (("status", status), ("pipeline", pipeline),
                                ("limit", str(limit) if limit != DEFAULT_PAGE_SIZE else None),
                                ("cursor", cursor)) if v}
    return urlencode(params)


def _list_args(ctx: ApiContext, status: str | None, pipeline: str | None, limit: str | None
               ) -> tuple[JobStatus | None, str | None, int]:
    """The filters as the core takes them; unknown values are ignored (the page shows every job)."""
    pipe = pipeline if pipeline and pipeline in ctx.runtime.catalogue else None
    size = int(limit) if limit and limit.isascii() and limit.isdigit() and int(limit) in PAGE_SIZES else DEFAULT_PAGE_SIZE
    return _status_filter(status), pipe, size


@router.get("/jobs")
def jobs_page(request: Request, ctx: Ctx, who: Viewer,
              status: Annotated[str | None, Query(max_length=20)] = None,
              pipeline: Annotated[str | None, Query(max_length=100)] = None,
              cursor: Annotated[str | None, Query(max_length=32)] = None,
              limit: Annotated[str | None, Query(max_length=4)] = None) -> Response:
    status_, pipeline_, size = _list_args(ctx, status, pipeline, limit)
    jobs, next_cursor = list_jobs(ctx, who.tenant, status=status_, pipeline=pipeline_, cursor=cursor, limit=size)
    status_text = status_.value if status_ else None
    return templating.render(
        request, "jobs.html", viewer=who, jobs=jobs, status=status_text or "", pipeline=pipeline_ or "",
        pipelines=ctx.runtime.catalogue.names(), limit=size, page_sizes=PAGE_SIZES, cursor=cursor,
        next_url=f"/ui/jobs?{_list_query(status_text, pipeline_, size, next_cursor)}" if next_cursor else None,
        first_url=f"/ui/jobs?{_list_query(status_text, pipeline_, size)}".rstrip("?") if cursor else None,
        stream_url=f"/ui/jobs/stream?{_list_query(status_text, pipeline_, size, cursor)}".rstrip("?"),
        **_row_helpers())


def _row_helpers() -> dict[str, Any]:
    return {"progress": views.progress, "final": views.FINAL}


def _sse(event: str, data: Any, event_id: str | None = None) -> str:
    lines = [f"id: {event_id}"] if event_id else []
    lines.append(f"event: {event}")
    lines.append("data: " + json.dumps(data, separators=(",", ":")))
    return "\n".join(lines) + "\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Content-Type-Options": "nosniff"}


@router.get("/jobs/stream")
async def jobs_stream(request: Request, ctx: Ctx, who: Viewer,
                      status: Annotated[str | None, Query(max_length=20)] = None,
                      pipeline: Annotated[str | None, Query(max_length=100)] = None,
                      cursor: Annotated[str | None, Query(max_length=32)] = None,
                      limit: Annotated[str | None, Query(max_length=4)] = None) -> StreamingResponse:
    """The list's rows, re-sent whenever they change (new jobs, status, stage, progress)."""
    status_, pipeline_, size = _list_args(ctx, status, pipeline, limit)

    def rows() -> str:
        jobs, _ = list_jobs(ctx, who.tenant, status=status_, pipeline=pipeline_, cursor=cursor, limit=size)
        return templating.render_fragment("_job_rows.html", jobs=jobs, status=status_.value if status_ else "",
                                          pipeline=pipeline_ or "", **_row_helpers())

    async def stream() -> AsyncIterator[str]:
        yield f"retry: {int(LIST_POLL_S * 2000)}\n\n"
        last = await run_in_threadpool(rows)  # what the page showed (or near enough): send only changes
        checked = sent = time.monotonic()
        while not await request.is_disconnected():
            await asyncio.sleep(LIST_POLL_S)
            if time.monotonic() - checked > LIST_REVERIFY_S and who.signed_in:
                checked = time.monotonic()
                try:
                    await run_in_threadpool(session.viewer, request, ctx)
                except session.NotSignedIn:
                    yield _sse("signed-out", {})
                    return
            try:
                html = await run_in_threadpool(rows)
            except redis.ConnectionError:
                yield ": redis unavailable\n\n"
                continue
            if html != last:
                last, sent = html, time.monotonic()
                yield _sse("rows", {"html": html})
            elif time.monotonic() - sent > KEEPALIVE_S:
                sent = time.monotonic()
                yield ": keep-alive\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)


# --- one job ---
def _present_one(ctx: ApiContext, job_id: str, tenant: str) -> dict[str, Any]:
    job = ctx.runtime.jobs.require(job_id, tenant=tenant)
    position = ctx.runtime.jobs.queue_position(job) if not job.status.is_final else None
    return ctx.runtime.present(job, queue_position=position)


NOTICES = {
    "canceled": "The job was canceled.",
    "already-finished": "The job had already finished; nothing to cancel.",
    "submitted": "Job submitted.",
}


@router.get("/jobs/{job_id}")
def job_page(job_id: str, request: Request, ctx: Ctx, who: Viewer, notice: str | None = None) -> Response:
    job = _present_one(ctx, job_id, who.tenant)
    # A job's webhooks are delivered after it ends: a page opened on a finished job follows them too,
    # until the final one is answered (the stream ends at once where nothing is left to send).
    hook = job.get("webhook")
    follow_webhooks = hook is not None and not _delivered(hook.get("deliveries"))
    catalogue = ctx.runtime.catalogue
    spec = catalogue.get(job["pipeline"]) if job.get("pipeline") in catalogue else None
    return templating.render(request, "job.html", viewer=who, notice=NOTICES.get(notice or ""),
                             follow_webhooks=follow_webhooks, live_audio=views.streamed_audio(spec),
                             **views.job_context(job))


def render_sections(job: dict[str, Any], token: str) -> dict[str, str]:
    context = {**views.job_context(job), "csrf_token": token, "csrf_field": session.CSRF_FIELD}
    return {name: templating.render_fragment(f"job/{name}.html", **context) for name in views.JOB_SECTIONS}


@router.get("/jobs/{job_id}/stream")
async def job_stream(job_id: str, request: Request, ctx: Ctx, who: Viewer,
                     after: Annotated[str | None, Query(max_length=64)] = None) -> StreamingResponse:
    """The job page's live parts, re-rendered as the job's events come (and partial outputs as they stream)."""
    await run_in_threadpool(ctx.runtime.jobs.require, job_id, tenant=who.tenant)  # 404 for another tenant's job
    start = request.headers.get("last-event-id") or after or "0-0"
    if not STREAM_ID.match(start):
        start = "0-0"
    token = session.csrf_token(request)
    watcher = ctx.watcher
    slot = ctx.streams.take(who.tenant)  # a live page follows its job as an SSE stream does (api.streams)

    async def sections(event_id: str | None) -> tuple[str, dict[str, Any]]:
        job = await run_in_threadpool(_present_one, ctx, job_id, who.tenant)
        payload = {"status": job["status"], "final": job["status"] in views.FINAL,
                   "sections": await run_in_threadpool(render_sections, job, token)}
        return _sse("sections", payload, event_id), job

    def webhooks_pending() -> bool:
        return any(m.pending for m in ctx.runtime.store.webhook_slots(job_id).values())

    async def webhook_tail(job: dict[str, Any], event_id: str | None) -> AsyncIterator[str]:
        """Deliveries are recorded after the job ends: follow them while any of its webhook messages is
        still queued or being sent, so the page shows how each ended. (A fixed 30 s once ended before
        a delivery that a loaded machine made later.)"""
        seen = (job.get("webhook") or {}).get("deliveries")
        deadline = time.monotonic() + WEBHOOK_TAIL_S
        while job.get("webhook") and time.monotonic() < deadline and not _delivered(seen):
            await asyncio.sleep(WEBHOOK_POLL_S)
            if await request.is_disconnected():
                return
            pending = await run_in_threadpool(webhooks_pending)  # read first: the render below then has
            text, job = await sections(event_id)                   # every attempt recorded before it
            deliveries = (job.get("webhook") or {}).get("deliveries")
            if deliveries != seen:
                seen = deliveries
                yield text
            if not pending:
                return

    async def stream() -> AsyncIterator[str]:
        yield "retry: 2000\n\n"
        try:
            text, job = await sections(None if start == "0-0" else start)
        except JobNotFound:
            yield _sse("end", {"reason": "gone"})
            return
        yield text
        try:
            async for text in follow(job):
                yield text
        except JobNotFound:  # expired or deleted while the page was open
            yield _sse("end", {"reason": "gone"})
            return
        yield _sse("end", {"reason": "final"})

    async def follow(job: dict[str, Any]) -> AsyncIterator[str]:
        last_id: str | None = None
        if job["status"] not in views.FINAL:
            last_render = quiet = time.monotonic()
            dirty: str | None = None
            async for event in watcher.follow(job_id, after=start, heartbeat_s=JOB_HEARTBEAT_S):
                now = time.monotonic()
                if event is None:
                    if dirty is not None:
                        text, job = await sections(dirty)
                        dirty, last_render, quiet = None, now, now
                        yield text
                    elif now - quiet > KEEPALIVE_S:
                        quiet = now
                        yield ": keep-alive\n\n"
                    continue
                last_id = event.id
                if event.type in LIVE_OUTPUT_EVENTS:
                    if "codes" in event.data:  # a talker's speech codes, every 100 ms: code2wav's, not for people
                        continue
                    yield _sse(event.type, event.model_dump(mode="json"), event.id)
                    quiet = now
                    continue
                dirty = event.id
                if event.type in FINAL_EVENTS or now - last_render >= RENDER_EVERY_S:
                    text, job = await sections(event.id)
                    dirty, last_render, quiet = None, now, now
                    yield text
            if dirty is not None:
                text, job = await sections(dirty)
                yield text
        async for text in webhook_tail(job, last_id):
            yield text

    return StreamingResponse(slot.guard(stream()), media_type="text/event-stream", headers=SSE_HEADERS)


def _delivered(deliveries: list[dict[str, Any]] | None) -> bool:
    """The final webhook got a 2xx: nothing more will be recorded."""
    return any(d.get("event") == "completed" and 200 <= (d.get("status_code") or 0) < 300
               for d in deliveries or [])


@router.post("/jobs/{job_id}/cancel")
async def cancel(job_id: str, request: Request, ctx: Ctx, who: Viewer) -> Response:
    form = await request.form()
    session.check_csrf(request, form.get(session.CSRF_FIELD))
    await run_in_threadpool(ctx.runtime.jobs.require, job_id, tenant=who.tenant)
    try:
        await run_in_threadpool(cancel_job, ctx.runtime.jobs, job_id)
        notice = "canceled"
    except JobAlreadyFinished:
        notice = "already-finished"
    return RedirectResponse(f"/ui/jobs/{job_id}?notice={notice}", status_code=303)


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The one range of a ``Range: bytes=a-b`` header (a suffix ``-n`` too), or None for the whole file."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first, _, last = header[6:].strip().partition("-")
    try:
        if first == "":
            length = int(last)
            return (max(0, size - length), size - 1) if length > 0 else None
        start = int(first)
        end = min(int(last), size - 1) if last else size - 1
    except ValueError:
        return None
    return (start, end) if start <= end else None


@router.get("/jobs/{job_id}/outputs/{name}")
def output_file(job_id: str, name: str, request: Request, ctx: Ctx, who: Viewer, download: bool = False) -> Response:
    """An output's bytes for <img>/<audio>/<video> and download links, with byte ranges (seeking)."""
    job = ctx.runtime.jobs.require(job_id, tenant=who.tenant)
    out = job.output(name)
    if out is None:
        raise JobNotFound(f"{job_id}/outputs/{name}")
    try:
        data = ctx.runtime.artifacts.get(out.artifact)
    except ArtifactNotFound:
        raise JobNotFound(f"{job_id}/outputs/{name}") from None
    return _file_response(request, data, out.media_type, out.artifact.key.rsplit("/", 1)[-1], download=download)


@router.get("/jobs/{job_id}/inputs/{name}")
def input_file(job_id: str, name: str, request: Request, ctx: Ctx, who: Viewer, download: bool = False) -> Response:
    """A file input's stored bytes (its PNG, WAV or MP4 under jobs/{id}/inputs/), to show or play it back."""
    job = ctx.runtime.jobs.require(job_id, tenant=who.tenant)
    record = job.input.get(name)
    ref = views.input_artifact(job_id, record)
    if ref is None:
        raise JobNotFound(f"{job_id}/inputs/{name}")
    try:
        data = ctx.runtime.artifacts.get(ref)
    except ArtifactNotFound:
        raise JobNotFound(f"{job_id}/inputs/{name}") from None
    return _file_response(request, data, ref.media_type, ref.key.rsplit("/", 1)[-1], download=download)


def _file_response(request: Request, data: bytes, media_type: str, filename: str, *, download: bool) -> Response:
    """A stored file, inline or as a download, with byte ranges (seeking in <audio>/<video>)."""
    headers = {
        "Accept-Ranges": "bytes",
        "Content-Disposition": f'{"attachment" if download else "inline"}; filename="{filename}"',
        "Cache-Control": "private, max-age=3600",  # outputs and inputs never change once written
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": "default-src 'none'; sandbox",
    }
    size = len(data)
    wanted = request.headers.get("range")
    span = _byte_range(wanted, size)
    if wanted and span is None and wanted.startswith("bytes=") and size and "," not in wanted:
        return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"})
    if span is not None and span[0] < size:
        start, end = span
        return Response(data[start:end + 1], status_code=206, media_type=media_type,
                        headers={**headers, "Content-Range": f"bytes {start}-{end}/{size}"})
    return Response(data, media_type=media_type, headers=headers)


# --- batches and usage (omni_jobs.accept.batches, omni_jobs.report.usage) ---
def _when(at: object) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(at))) if isinstance(at, int | float) else ""


def _day(at: object) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(float(at))) if isinstance(at, int | float) else ""


@router.get("/batches")
def batches_page(request: Request, ctx: Ctx, who: Viewer) -> Response:
    page = ctx.runtime.batches.page(who.tenant, limit=100)
    return templating.render(request, "batches.html", viewer=who, batches=page["data"], when=_when)


@router.get("/usage")
def usage_page(request: Request, ctx: Ctx, who: Viewer,
               days: Annotated[int, Query(ge=1, le=366)] = 7) -> Response:
    admin = who.tenant in ctx.runtime.settings.admin_tenants
    end = time.time()
    flush_pending()  # this process's last commits too
    page = read_usage(ctx.runtime.redis, tenants=None if admin else [who.tenant], start=end - days * DAY_S, end=end)
    return templating.render(request, "usage.html", viewer=who, buckets=page["data"], days=days, admin=admin,
                             day=_day)


# --- pipelines and the playground ---
@router.get("/pipelines")
def pipelines_page(request: Request, ctx: Ctx, who: Viewer) -> Response:
    specs = list(ctx.runtime.catalogue)
    return templating.render(request, "pipelines.html", viewer=who, specs=specs,
                             graphs={s.name: graph.layout(s) for s in specs})


def _playground(request: Request, ctx: ApiContext, who: session.Viewer, form: forms.PipelineForm,
                status_code: int = 200, from_job: str | None = None) -> Response:
    return templating.render(request, "playground.html", status_code=status_code, viewer=who, form=form,
                             spec=form.spec, graph=graph.layout(form.spec), submission=secrets.token_urlsafe(16),
                             pipelines=ctx.runtime.catalogue.names(), from_job=from_job)


@router.get("/pipelines/{name}")
def playground(name: str, request: Request, ctx: Ctx, who: Viewer,
               from_: Annotated[str | None, Query(alias="from", max_length=64)] = None) -> Response:
    form = forms.build_form(ctx.runtime.catalogue.get(name))
    if from_:
        try:
            earlier = ctx.runtime.present(ctx.runtime.jobs.require(from_, tenant=who.tenant))
        except JobNotFound:
            earlier = None
        if earlier is not None and earlier["pipeline"] == name:
            forms.prefill(form, earlier)
        else:
            from_ = None
    return _playground(request, ctx, who, form, from_job=from_)


@router.post("/pipelines/{name}")
async def submit(name: str, request: Request, ctx: Ctx, who: Viewer) -> Response:
    spec = ctx.runtime.catalogue.get(name)
    data = await request.form()
    session.check_csrf(request, data.get(session.CSRF_FIELD))
    form = forms.build_form(spec)
    parsed = await forms.parse_form(form, data)
    if parsed.errors:
        form.attach(parsed.errors)
        return _playground(request, ctx, who, form, status_code=422)
    submission = data.get("submission")
    idempotency_key = f"ui-{submission}" if isinstance(submission, str) and 8 <= len(submission) <= 64 else None
    try:
        job, _created = await run_in_threadpool(
            ctx.submitter.submit_idempotent, name, parsed.input, parsed.params or None,
            cancel_after_s=parsed.cancel_after_s, idempotency_key=idempotency_key, webhook=parsed.webhook,
            tenant=who.tenant, api_key_id=who.key_id)  # the key's own quotas, as on POST /v1/jobs
    except InvalidRequest as exc:
        form.attach(exc.errors)
        return _playground(request, ctx, who, form, status_code=422)
    except IdempotencyConflict as exc:
        form.errors.append(f"This form was already used to submit job {exc.job_id}; submit again to start a new job.")
        return _playground(request, ctx, who, form, status_code=409)
    except Overloaded as exc:
        form.errors.append(f"The '{exc.queue}' queue is full right now; try again in {exc.retry_after_s} s.")
        return _playground(request, ctx, who, form, status_code=503)
    except QuotaExceeded as exc:
        QUOTA_REFUSALS.labels(exc.limit).inc()
        form.errors.append(f"Not submitted: {exc}.")
        refused = _playground(request, ctx, who, form, status_code=429)
        refused.headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
        return refused
    return RedirectResponse(f"/ui/jobs/{job.id}", status_code=303)
