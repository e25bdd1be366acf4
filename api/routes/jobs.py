"""/v1/jobs: submit, list, get, cancel, and download outputs."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, TypedDict

import redis
from fastapi import APIRouter, Depends, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError

from api import uploads
from api.auth import SubmitTenant, Tenant, api_key_id, authenticate_submit, bearer, key_guards, key_refused, recheck
from api.deps import ApiContext, context, get_context
from api.disconnect import while_connected
from api.json_body import read_json, validate_body
from api.prefer import prefer_wait
from api.responses import JSONText
from api.schemas import JobList, JobRequest, errors
from omni_jobs.artifacts import ArtifactCorrupted, ArtifactNotFound
from omni_jobs.core.errors import FieldError, InvalidRequest, JobNotFound, NotDurable
from omni_jobs.dispatch.cancellation import cancel_job
from omni_jobs.jobs.flows import Get, QueuePosition
from omni_jobs.jobs.ledger import RequirementFailed
from omni_jobs.jobs.models import Job, JobStatus
from omni_jobs.jobs.view import JobJSON, JobView, present_job
from omni_jobs.jobs.watch import mark_looked_at
from omni_jobs.media.audio_formats import AUDIO_FORMATS, ENCODINGS, AudioFormat, convert, is_wav

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"],  # every route takes the caller's tenant: authenticated
                   responses=errors(401, 503))
# The routes build the job JSON as a dict (omni_jobs.jobs.view.present_job) and FastAPI checks it
# against JobView; exclude_unset keeps it as built (an output's inapplicable fields stay absent).
class _JobResponse(TypedDict):
    """The route decorator's keyword arguments for a route that answers a job."""

    response_model: type[JobView]
    response_model_exclude_unset: bool


JOB: _JobResponse = {"response_model": JobView, "response_model_exclude_unset": True}
Ctx = Annotated[ApiContext, Depends(context)]


def _present(ctx: ApiContext, job: Job, *, queue_position: bool = False, position: int | None = None) -> JobJSON:
    """The job object; ``queue_position``: read its place (a Redis read), or pass it as ``position``."""
    settings = ctx.runtime.settings
    if queue_position:
        position = ctx.runtime.jobs.queue_position(job)
    return present_job(job, public_url=settings.public_url, artifacts=ctx.runtime.artifacts,
                       presign=settings.output_urls == "presigned", queue_position=position)


_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$", re.ASCII)  # ASCII digits, as the spec's pattern says


def parse_cancel_after(value: str) -> float:
    """``90``, ``90s``, ``5m``, ``1h30m`` -> seconds (the Cancel-After header, as Replicate takes it)."""
    match = _DURATION.match(value.strip())
    if not value.strip() or match is None or not any(match.groups()):
        raise InvalidRequest([FieldError(("header", "Cancel-After"),
                                         f"{value!r} is not a duration like 90, 90s, 5m or 1h30m")])
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds


@dataclass(frozen=True)
class SubmitHeaders:
    idempotency_key: str | None
    cancel_after: str | None
    prefer: list[str]


_SUBMIT_HEADERS: dict[bytes, tuple[str, int, str]] = {
    b"idempotency-key": ("idempotency_key", 255, "Same key + same body returns the same job; a different body: 409."),
    b"cancel-after": ("cancel_after", 32, (
        "Cancel the job if it has not finished after this long (90s, 5m, 1h30m), at most OMNI_MAX_CANCEL_AFTER_S: "
        "the pattern lists durations always within it; a longer one is checked against it (422 above it).")),
}
_UNITS = {"h": 3600, "m": 60, "s": 1}


def cancel_after_pattern(max_s: float | None = None) -> str:
    """What parse_cancel_after takes, some non-zero number of h, m and s, as a pattern; with ``max_s``
    (OMNI_MAX_CANCEL_AFTER_S) only durations that are always within it: each unit gets as many
    digits as keeps their sum under ``max_s`` (99h, 999m, 99999s for a week). A pattern cannot add,
    so a longer duration that is still within it (168h) is accepted though the spec leaves it out."""
    digits: dict[str, int | None] = dict.fromkeys(_UNITS)  # None: any number
    if max_s is not None:
        bounded = {unit: max(0, math.floor(math.log10(max_s / size))) for unit, size in _UNITS.items()}
        while sum(10 ** d * _UNITS[u] for u, d in bounded.items() if d) > max_s:
            largest = max((u for u, d in bounded.items() if d), key=lambda u: 10 ** bounded[u] * _UNITS[u])
            bounded[largest] -= 1
        digits = dict(bounded)
    groups = []
    for unit, count in digits.items():
        if count != 0:
            repeat = "+" if count is None else f"{{1,{count}}}"
            groups.append(f"(?:[0-9]{repeat}(?:\\.[0-9]+)?{unit}{'?' if unit == 's' else ''})?")
    return rf"^(?=[0-9])(?=[0-9.hms]*[1-9]){''.join(groups)}$"


_PATTERNS = {"cancel_after": cancel_after_pattern()}  # api.main bounds it by the setting
SUBMIT_HEADERS_OPENAPI: dict[str, Any] = {"parameters": [
    {"name": name.decode(), "in": "header", "required": False, "description": doc,
     "schema": {"type": "string", "maxLength": limit, "title": field.title(),
                **({"pattern": _PATTERNS[field]} if field in _PATTERNS else {})}}
    for name, (field, limit, doc) in _SUBMIT_HEADERS.items()]}


async def submit_headers(request: Request) -> SubmitHeaders:
    """Idempotency-Key, Cancel-After and Prefer in one pass over the raw headers. Declared as
    Header() parameters, FastAPI looks each one up on its own (an exception per absent header), a
    few per cent of a submit's CPU; the limits and the 422 are the same."""
    found: dict[str, str] = {}
    prefer: list[str] = []
    for name, value in request.scope["headers"]:
        known = _SUBMIT_HEADERS.get(name)
        if known is not None:
            found[known[0]] = value.decode("latin-1")
        elif name == b"prefer":
            prefer.append(value.decode("latin-1"))
    errors = [{"type": "string_too_long", "loc": ("header", header.decode()), "input": found[field],
               "msg": f"String should have at most {limit} characters", "ctx": {"max_length": limit}}
              for header, (field, limit, _doc) in _SUBMIT_HEADERS.items() if len(found.get(field, "")) > limit]
    if errors:
        raise RequestValidationError(errors)
    return SubmitHeaders(found.get("idempotency_key"), found.get("cancel_after"), prefer)


Headers = Annotated[SubmitHeaders, Depends(submit_headers)]


SUBMIT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": JobView, "description": "With `Prefer: wait=N`: the job ended within N seconds."},
    202: {"description": "Accepted: the job is queued (Location: its URL). A replay of an Idempotency-Key "
          "answers the same job with `Idempotent-Replayed: true`."},
    **errors(400, 409, 413, 422, 429, e409="The Idempotency-Key was used with another body."),
}


SUBMIT_BODY_OPENAPI: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobRequest"}}}},
    "security": [{"HTTPBearer": []}],
}
"""POST /v1/jobs reads its own body and key (api.json_body): what FastAPI would have said of them in the spec."""


@router.post("", status_code=status.HTTP_202_ACCEPTED, summary="Submit a job",
             openapi_extra={**SUBMIT_HEADERS_OPENAPI, **SUBMIT_BODY_OPENAPI}, responses=SUBMIT_RESPONSES, **JOB)
async def create_job(request: Request) -> Any:
    # The route takes only the request: FastAPI's body and dependency handling was about a sixth of
    # a submit's CPU (api.json_body). The checks and their order are FastAPI's: JSON syntax, the key
    # (401), the headers, then the body's fields.
    value = await read_json(request)
    tenant = await authenticate_submit(request, await bearer(request))
    headers = await submit_headers(request)
    return await _submit(get_context(request), request, validate_body(JobRequest, value), tenant, headers)


async def _submit(ctx: ApiContext, request: Request, body: JobRequest, tenant: str, headers: SubmitHeaders) -> Any:
    idempotency_key, cancel_after = headers.idempotency_key, headers.cancel_after
    cancel_after_s = parse_cancel_after(cancel_after) if cancel_after is not None else None
    # On the event loop, no thread: validation is pure, and the job, its dispatch, the quota and
    # queue checks and the queue position read are one Redis round trip (asubmit_idempotent).
    # The API key was checked from a cache (api.auth.authenticate_submit); the write checks it again.
    try:
        submitted = await ctx.submitter.asubmit_idempotent(
            body.pipeline, body.input, body.params, cancel_after_s=cancel_after_s, idempotency_key=idempotency_key,
            webhook=body.webhook, webhook_events_filter=body.webhook_events_filter, tenant=tenant,
            priority=body.priority, api_key_id=api_key_id(request), requires=key_guards(request),
        )
    except RequirementFailed:
        raise key_refused() from None
    except NotDurable as exc:
        if exc.job_id is None:
            raise
        return await _not_durable(ctx, exc, exc.job_id)
    if not submitted.created:  # a replay wrote nothing, so nothing checked the key: check it now
        await recheck(request)
    job, position = submitted.job, submitted.queue_position
    answer_headers = {"Location": f"/v1/jobs/{job.id}"}
    if not submitted.created:
        answer_headers["Idempotent-Replayed"] = "true"
    code = status.HTTP_202_ACCEPTED
    # Prefer: wait=N (RFC 7240): hold the answer until the job ends, N capped by OMNI_MAX_PREFER_WAIT_S.
    # A wait holds a Redis connection: past the tenant's (or the process's) streams (api.streams) the
    # submit is answered at once, the preference not applied (RFC 7240 lets a server ignore it).
    wait_s = prefer_wait(headers.prefer)
    slot = ctx.streams.try_take(tenant) if wait_s is not None else None
    if wait_s is not None and slot is not None:
        try:
            wait_s = min(wait_s, ctx.runtime.settings.max_prefer_wait_s)
            answer_headers["Preference-Applied"] = f"wait={wait_s:g}"
            # a client that leaves stops a job nobody can find again (no Idempotency-Key): api.disconnect
            waited = await while_connected(request, ctx.watcher.wait_final(job.id, wait_s), ctx.runtime.jobs,
                                           [job.id], idempotent=idempotency_key is not None)
            job = waited or job
        finally:
            slot.release()
        if job.status.is_final:
            code = status.HTTP_200_OK
        position = await ctx.runtime.jobs.store.arun(QueuePosition(job))
    # The job JSON as built, past FastAPI's response_model pass: that pass validates the dict as a
    # JobView again, about a tenth of a submit's CPU (bench.submit). JobView stays its documented
    # shape; the e2e tests check every job JSON they see against it.
    return JSONText(_present(ctx, job, position=position), status_code=code, headers=answer_headers)


def corrupted(exc: ArtifactCorrupted, what: str) -> JSONText:
    """A stored file whose bytes are not the ones the job recorded (its size or sha256): 502, the
    artifact store having answered with other bytes. No system write replaces a recorded file (each
    attempt writes under keys of its own: omni_jobs.report.results), so something else changed it."""
    log.error("%s: %s", what, exc)
    return JSONText({"detail": f"the stored file of {what} does not match the job's record of it (it was "
                               "changed outside this system); ask the operator to restore it, or run the job again"},
                    status_code=status.HTTP_502_BAD_GATEWAY)


async def _not_durable(ctx: ApiContext, exc: NotDurable, job_id: str) -> JSONText:
    """A submit whose write applied but did not reach the disk or a replica in time: still a 503 (a 202
    is given only once the job is durable), naming the job that was made, with its URL: a client that
    resubmitted without its Idempotency-Key would run it twice. The job, as far as it can be read."""
    log.warning("submit not durable in time: %s", exc)
    body: dict[str, Any] = {"detail": str(exc), "job_id": job_id}
    try:
        job = await ctx.runtime.jobs.store.arun(Get(job_id))
    except redis.RedisError:
        job = None
    if job is not None:
        body["job"] = _present(ctx, job)
    return JSONText(body, status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                    headers={"Location": f"/v1/jobs/{job_id}", "Retry-After": "5"})


@router.post("/multipart", status_code=status.HTTP_202_ACCEPTED,
             openapi_extra={**uploads.OPENAPI, **SUBMIT_HEADERS_OPENAPI}, responses=SUBMIT_RESPONSES, **JOB,
             summary="Submit a job with file inputs (multipart/form-data)",
             description="The same as POST /v1/jobs, with the body as form fields (input and params as JSON "
             "text) and each file input as a part named input.<field>, e.g. input.image. Files may also be "
             "sent to POST /v1/jobs as base64 or as a reference to a stored output.")
async def create_job_multipart(ctx: Ctx, request: Request, tenant: SubmitTenant, headers: Headers) -> Any:
    body = await uploads.job_request_from_form(request, ctx.runtime.catalogue)
    return await _submit(ctx, request, body, tenant, headers)


CURSOR = r"^[0-9]+$"
"""A cursor is an offset the list gave (ASCII digits: '²'.isdigit() is true, int('²') raises); any other
value is a 422 naming it, where it used to be a 500, or the first page again (a client paging forever)."""


@router.get("", summary="List jobs, newest first", response_model_exclude_unset=True, responses=errors(422))
def list_jobs(
    ctx: Ctx,
    tenant: Tenant,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    cursor: Annotated[str | None, Query(max_length=32, pattern=CURSOR,
                                        description="A list's next_cursor: where the next page starts.")] = None,
    status_: Annotated[JobStatus | None, Query(alias="status")] = None,
) -> JobList:
    limit = min(limit, ctx.runtime.settings.max_page_size)
    page = ctx.runtime.jobs.page(limit=limit, cursor=cursor, status=status_, tenant=tenant)
    return JobList(data=[_present(ctx, j) for j in page.jobs], next_cursor=page.next_cursor)


@router.get("/{job_id}", summary="Get a job", responses=errors(404), **JOB)
def get_job(job_id: str, ctx: Ctx, tenant: Tenant) -> Any:
    job = ctx.runtime.jobs.require(job_id, tenant=tenant)
    if not job.status.is_final:  # somebody polls it: its stages write their progress often for a while
        mark_looked_at(ctx.runtime.redis, job.id)
    return _present(ctx, job, queue_position=True)


@router.post("/{job_id}/cancel", summary="Cancel a queued or running job",
             responses=errors(404, 409, e409="The job already finished: nothing to cancel."), **JOB)
def cancel(job_id: str, ctx: Ctx, tenant: Tenant) -> Any:
    ctx.runtime.jobs.require(job_id, tenant=tenant)  # another tenant's job: 404, as if unknown
    return _present(ctx, cancel_job(ctx.runtime.jobs, job_id))


AUDIO_FORMAT_DOC = (f"Audio outputs only: the audio re-encoded as {', '.join(AUDIO_FORMATS)} (omni_jobs.media.audio_formats; "
                    "pcm: raw 16-bit LE mono at 24 kHz, as OpenAI's). Absent: the stored file as it is.")


@router.get("/{job_id}/outputs/{name}", summary="Download one output file", response_class=Response,
            responses={200: {"description": "The output's bytes, with its media type (with `format`: that format's).",
                             "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}}},
                       **errors(404, 422, e404="No such job (for this tenant), output, or stored file.",
                                e422="`format` is not one of the audio formats, or the output is not audio."),
                       502: {"description": "The stored file does not match the job's record of it (size or "
                             "sha256): it was changed outside this system."}})
def download_output(job_id: str, name: str, ctx: Ctx, tenant: Tenant,
                    format_: Annotated[AudioFormat | None, Query(alias="format", description=AUDIO_FORMAT_DOC)] = None,
                    ) -> Response:
    job = ctx.runtime.jobs.require(job_id, tenant=tenant)
    out = job.output(name)
    if out is None:
        raise JobNotFound(f"{job_id}/outputs/{name}")
    if format_ is not None and (out.type != "audio" or not is_wav(out.media_type)):
        raise InvalidRequest([FieldError(("query", "format"), f"output '{name}' is {out.type} ({out.media_type}); "
                                         f"format ({', '.join(AUDIO_FORMATS)}) converts WAV audio outputs only: "
                                         "leave it out to download the file as stored", "unsupported_format")])
    try:
        data = ctx.runtime.artifacts.get(out.artifact)
    except ArtifactNotFound:
        raise JobNotFound(f"{job_id}/outputs/{name}") from None
    except ArtifactCorrupted as exc:  # never a 500: the store gave bytes other than those recorded
        return corrupted(exc, f"{job_id}/outputs/{name}")
    filename = out.artifact.key.rsplit("/", 1)[-1]
    media_type_ = out.media_type
    if format_ is not None:
        try:
            data = convert(data, format_)
        except ValueError as exc:  # the recorded bytes, yet no WAV codecs reads: say so, never a 500
            log.error("%s/outputs/%s is not a readable WAV: %s", job_id, name, exc)
            raise InvalidRequest([FieldError(("query", "format"), f"output '{name}' is not a WAV this server can "
                                             f"convert ({exc}); leave format out to download it as stored",
                                             "unsupported_format")]) from None
        filename = filename.rsplit(".", 1)[0] + ENCODINGS[format_].extension
        media_type_ = ENCODINGS[format_].media_type
    return Response(
        content=data,
        media_type=media_type_,
        headers={"Content-Disposition": f'inline; filename="{filename}"'},
    )
