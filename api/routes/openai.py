"""OpenAI-compatible endpoints over jobs, so existing OpenAI clients work unchanged.

Each call is an ordinary job (visible in /v1/jobs, Flower and the metrics): it is submitted through
the JobSubmitter, waited on here (the job's event stream, no polling), and its outputs are answered
in OpenAI's shape, the way ``vllm serve --omni`` answers:

- ``POST /v1/chat/completions``: text in; ``modalities`` (default ``["text"]``) picks what comes back,
  one choice per modality: text as ``content``, images as ``content`` parts
  ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``, audio as
  ``message.audio`` ``{id, data (base64, in audio.format: wav by default), expires_at, transcript}``;
  ``audio.voice`` sets the pipeline's voice input.
  User messages may carry media parts (``image_url``, ``input_audio``, ``audio_url``, ``video_url``)
  for a pipeline whose inputs take them (omni_jobs.accept.openai_content).
- ``POST /v1/images/generations`` (DALL-E shape; ``n`` jobs, ``b64_json`` by default as vLLM-Omni
  does, or ``url``); ``POST /v1/audio/speech`` (the speech in
  ``response_format``: mp3 by default, opus, aac, flac, wav, pcm; ``voice`` as the pipeline's voice input); ``GET /v1/models`` (the pipelines).
- ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` (multipart ``file``; Whisper's
  answer in json, verbose_json, text, srt or vtt, made from the speech stage's document by
  omni_jobs.accept.openai_audio).

Which pipeline runs and with what input and params, and the answer's body from the finished jobs,
are omni_jobs.accept.openai_requests and openai_responses (pure functions); this module translates HTTP: it parses, submits,
waits, reads the output bytes and answers. The answer's ``model`` says which pipeline ran, and the
``X-Omni-Job-Id`` header names the job(s).

Errors use OpenAI's body ``{"error": {message, type, param, code}}``: 400 names the parameter; a
``model`` that is neither a pipeline nor one of OpenAI's names is 404 ``model_not_found``; a
job that failed answers 500 and one still running after OMNI_OPENAI_WAIT_S answers 504, both with
``x-should-retry: false`` because retrying would start another job. A client that disconnects before
its answer (waiting, or mid-stream) has the call's jobs canceled unless it sent an Idempotency-Key
(api.disconnect): a retry without one would run them twice.

Chat with ``stream: true`` answers in OpenAI's chunk format while the job runs: the AR stage's
``output.delta`` events become content chunks (omni_jobs.run.text_stream cuts them); the job's end
gives the chunk with ``finish_reason`` (and, with ``stream_options.include_usage``, the usage
chunk), then ``data: [DONE]``. A job that fails sends an ``{"error": ...}`` chunk, as OpenAI does.
With the audio modality the chunks carry ``delta.audio`` instead: transcript pieces, base64 pcm16
from the audio output's deltas and then the final clip, and last its ``expires_at``. The chunk framing stays here: it is interleaved with reading the job's event stream and its
stored text (I/O at every step), and its pure part (cutting deltas) is omni_jobs.run.text_stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Header, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from api.auth import api_key_id, authenticate
from api.deps import ApiContext, get_context
from api.disconnect import until_closed, while_connected
from api.schemas import errors
from api.streams import RETRY_AFTER_S, Slot
from omni_jobs.accept.openai_audio import (
    FILE_FIELD,
    Task,
    plan_transcription,
    read_form,
    read_transcript,
    transcription_answer,
)
from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.accept.openai_requests import (
    ChatCompletionRequest,
    ImageGenerationRequest,
    Plan,
    SpeechRequest,
    audio_source,
    invalid_request,
    plan_chat,
    plan_images,
    plan_speech,
    text_source,
)
from omni_jobs.accept.openai_responses import (
    audio_delta_message,
    chat_completion,
    finished,
    first_output,
    image_items,
    images_response,
    model_card,
    needed_outputs,
    speech_event,
    streamed_pcm,
    text_meta,
    text_of,
    unsent_pcm,
)
from omni_jobs.artifacts import ArtifactError, codecs
from omni_jobs.core.errors import InvalidRequest, QuotaExceeded
from omni_jobs.core.logs import bind
from omni_jobs.jobs.models import FINAL_EVENTS, EventType, Job, JobEvent, JobOutput, JobStatus
from omni_jobs.jobs.view import output_url
from omni_jobs.media.audio_formats import AudioFormat, convert, media_type
from omni_jobs.pipelines.spec import PipelineSpec
from omni_jobs.run.audio_stream import AudioDeltaReader
from omni_jobs.run.text_stream import DeltaReader


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, requests (429), server_error, timeout.")
    param: str | None = Field(description="The request field at fault, when one is.")
    code: str | None = Field(description="e.g. unsupported_modality, model_not_found, job_failed, job_timeout.")


class OpenAIErrorBody(BaseModel):
    """OpenAI's error shape, which its clients parse."""

    error: OpenAIErrorDetail


def _openai_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {400: "A field is invalid or not supported by the chosen pipeline; `param` names it.",
            404: "No such model: `model` is neither a pipeline (GET /v1/models) nor one of OpenAI's model names "
                 "(OMNI_OPENAI_MODEL_ALIASES); code model_not_found.",
            429: "A tenant quota was reached (`param` names it); retry after Retry-After.",
            500: "The job failed or was canceled (`X-Omni-Job-Id` names it; x-should-retry: false).",
            504: "The job did not end within OMNI_OPENAI_WAIT_S; follow it at GET /v1/jobs/{id} "
                 "(x-should-retry: false)."}
    return {code: {"model": OpenAIErrorBody, "description": text[code]} for code in codes}


# 401 and 503 come from the shared auth and store handlers, in the API's {"detail": ...} shape.
router = APIRouter(prefix="/v1", tags=["openai"], responses=errors(401, 503))
JOB_ERRORS = {**_openai_errors(400, 404, 429, 500, 504), **errors(413)}

OPENAI_PATHS = ("/v1/chat/completions", "/v1/images/generations", "/v1/audio/speech", "/v1/audio/transcriptions",
                "/v1/audio/translations", "/v1/models")
TRANSCRIPTION_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
"""Their form is api.main's to describe (omni_jobs.accept.openai_audio.form_body, with the running catalogue)."""
STARTED = int(time.time())


# --- errors in OpenAI's shape ---
def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


def _openai_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return error_response(exc)


async def _validation_error(request: Request, exc: Exception) -> Response:
    """Bad bodies on the OpenAI paths answer 400 in OpenAI's shape; elsewhere FastAPI's 422 stays."""
    assert isinstance(exc, RequestValidationError)
    if not request.url.path.startswith(OPENAI_PATHS):
        return await request_validation_exception_handler(request, exc)
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return error_response(OpenAIError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")),
                                      param=param))


def _allowed_methods(request: Request) -> str:
    """The methods of the path the request names, as the spec lists them: Starlette's 405 names those
    of one route, and GET /v1/jobs and POST /v1/jobs are two. The first route that matches picks the
    path: POST /v1/jobs/multipart, not GET /v1/jobs/{job_id} with the id 'multipart'."""
    matching = [route for route in request.app.router.routes
                if isinstance(route, Route) and route.methods and route.matches(request.scope)[0] is not Match.NONE]
    methods = {method for route in matching if route.path == matching[0].path for method in route.methods or ()}
    return ", ".join(sorted(methods))  # empty: no route matched (405 from elsewhere), Allow stays as it is


async def _http_error(request: Request, exc: Exception) -> Response:
    """A body that cannot be parsed (400) on the OpenAI paths answers in OpenAI's shape too; a 405
    lists every method of the path in Allow. This is the app's handler of every HTTPException."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 405 and (allowed := _allowed_methods(request)):
        exc.headers = {**(exc.headers or {}), "Allow": allowed}
    if exc.status_code == 400 and request.url.path.startswith(OPENAI_PATHS):
        return error_response(OpenAIError(400, str(exc.detail)))
    return await http_exception_handler(request, exc)


def install(app: FastAPI) -> None:
    """Add the routes and their error handlers to the API."""
    app.include_router(router, dependencies=[Depends(authenticate)])  # the same bearer key (the client's api_key)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


# --- jobs ---
def _wait_place(ctx: ApiContext, request: Request) -> Slot:
    """A place among the process's long requests (api.streams), taken before the job is made: every answer here
    waits on its job's events, holding a Redis connection. None left: a 429 (the tenant's) or a 503 (the
    process's) that OpenAI's clients retry after Retry-After, and no job was started."""
    tenant = request.state.tenant
    slot = ctx.streams.try_take(tenant)
    if slot is not None:
        return slot
    if ctx.streams.held(tenant) >= ctx.streams.per_tenant:
        raise OpenAIError(429, f"tenant '{tenant}' waits on {ctx.streams.per_tenant} answers or streams already "
                          "(OMNI_MAX_STREAMS_PER_TENANT); no job was started", code="rate_limit_exceeded",
                          type_="requests", retry_after_s=RETRY_AFTER_S)
    raise OpenAIError(503, f"this API process waits on {ctx.streams.total} answers or streams (OMNI_MAX_STREAMS); "
                      "no job was started", code="server_overloaded", type_="server_error",
                      retry_after_s=RETRY_AFTER_S)


async def _submit(ctx: ApiContext, plan: Plan, params: dict[str, dict[str, Any]], *, idempotency_key: str | None,
                  tenant: str, key_id: str | None = None, input_: dict[str, Any] | None = None) -> Job:
    """Submit one of the plan's jobs (``input_``: the plan's input with what the route adds, an upload's bytes)."""
    try:
        job: Job = await run_in_threadpool(ctx.submitter.submit, plan.spec.name,
                                           plan.input if input_ is None else input_, params,
                                           idempotency_key=idempotency_key, tenant=tenant, api_key_id=key_id)
    except InvalidRequest as exc:
        raise invalid_request(exc, plan) from None
    except QuotaExceeded as exc:  # OpenAI's clients back off and retry a 429 by themselves
        raise OpenAIError(429, str(exc), code="rate_limit_exceeded", type_="requests", param=exc.limit,
                          retry_after_s=exc.retry_after_s) from None
    bind(job_id=job.id)  # the access log line and anything logged below name the job
    return job


async def _submit_all(ctx: ApiContext, plan: Plan, idempotency_keys: list[str | None], *, tenant: str,
                      key_id: str | None) -> list[Job]:
    """Submit every job of the plan (images: ``n``) in one write, all or none: a 429 or 503 says that none
    of them was made, so nothing runs or is charged for a call that answered an error."""
    try:
        jobs: list[Job] = await run_in_threadpool(ctx.submitter.submit_all, plan.spec.name, plan.input, plan.params,
                                                  idempotency_keys=idempotency_keys, tenant=tenant,
                                                  api_key_id=key_id)
    except InvalidRequest as exc:
        raise invalid_request(exc, plan) from None
    except QuotaExceeded as exc:
        raise OpenAIError(429, f"{exc}; none of the {len(plan.params)} images was started (all or none)",
                          code="rate_limit_exceeded", type_="requests", param=exc.limit,
                          retry_after_s=exc.retry_after_s) from None
    bind(job_id=",".join(job.id for job in jobs))
    return jobs


async def _finished(ctx: ApiContext, jobs: list[Job], request: Request, *, idempotent: bool) -> list[Job]:
    """Wait for every job to end; answer their failure or the timeout in OpenAI's shape. A client that
    leaves meanwhile has its jobs canceled unless ``idempotent`` (api.disconnect): nobody could find them."""
    wait_s = ctx.runtime.settings.openai_wait_s
    waiting = asyncio.gather(*(ctx.watcher.wait_final(job.id, wait_s) for job in jobs))
    ids = [job.id for job in jobs]
    done = await while_connected(request, waiting, ctx.runtime.jobs, ids, idempotent=idempotent)
    if done is None:  # nobody reads this answer; the access log shows 499, as nginx's "client closed request"
        raise OpenAIError(499, f"the client disconnected; jobs {', '.join(ids)} "
                          f"{'keep running (Idempotency-Key)' if idempotent else 'were canceled'}",
                          type_="client_closed_request", job_ids=ids, retry=False)
    return finished(jobs, list(done), wait_s=wait_s)


def _streamed(ctx: ApiContext, stream: AsyncIterator[Any], job: Job, *, idempotent: bool) -> AsyncIterator[Any]:
    """A streamed answer whose job is canceled if its client leaves before the end (api.disconnect)."""
    return until_closed(stream, ctx.runtime.jobs, [job.id], idempotent=idempotent)


async def _bytes(ctx: ApiContext, output: JobOutput) -> bytes:
    data: bytes = await run_in_threadpool(ctx.runtime.artifacts.get, output.artifact)
    return data


async def _speech(ctx: ApiContext, job: Job, output: JobOutput, fmt: AudioFormat) -> bytes:
    """An audio output in ``fmt`` (omni_jobs.media.audio_formats, in a thread: encoding takes CPU); a stored file
    that is no WAV it can read answers 500 naming the job, never a traceback."""
    data = await _bytes(ctx, output)
    try:
        converted: bytes = await run_in_threadpool(convert, data, fmt)
    except ValueError as exc:
        raise OpenAIError(500, f"job {job.id}: its {output.name} output cannot be converted to {fmt}: {exc}",
                          type_="server_error", code="invalid_output", job_ids=[job.id], retry=False) from None
    return converted


async def _text_meta(ctx: ApiContext, spec: PipelineSpec, job: Job) -> tuple[str, dict[str, int] | None]:
    """openai_responses.text_meta, its artifact reads off the event loop."""
    meta: tuple[str, dict[str, int] | None] = await run_in_threadpool(text_meta, spec, job, ctx.runtime.artifacts.get)
    return meta


def _headers(jobs: list[Job]) -> dict[str, str]:
    return {"X-Omni-Job-Id": ",".join(j.id for j in jobs)}


# --- routes ---
IdempotencyKey = Annotated[str | None, Header(max_length=255, include_in_schema=False)]


@router.post("/chat/completions", summary="OpenAI chat completions (text, image or audio out), run as a job",
             responses={200: {"description": "The completion, or with stream=true its chunks (`data: {...}` "
                              "lines, then `data: [DONE]`).",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {}}},
                        **JOB_ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           idempotency_key: IdempotencyKey = None) -> Response:
    ctx = get_context(request)
    plan = plan_chat(ctx.runtime.catalogue, body, aliases=ctx.runtime.settings.openai_model_aliases)
    with _wait_place(ctx, request) as place:
        job = await _submit(ctx, plan, plan.params[0], idempotency_key=idempotency_key, tenant=request.state.tenant,
                            key_id=api_key_id(request))
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            chunks = _chat_chunks(ctx, plan, job, include_usage=include_usage)
            return StreamingResponse(place.guard(_streamed(ctx, chunks, job, idempotent=idempotency_key is not None)),
                                     media_type="text/event-stream",
                                     headers={**_headers([job]), "Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        (job,) = await _finished(ctx, [job], request, idempotent=idempotency_key is not None)
    finish, usage = await _text_meta(ctx, plan.spec, job)
    data = {out.name: await (_speech(ctx, job, out, plan.audio_format) if out.type == "audio" else _bytes(ctx, out))
            for out in needed_outputs(job, plan.wanted)}
    answer = chat_completion(plan, job, finish=finish, usage=usage, data=data,
                             output_ttl_s=ctx.runtime.settings.output_ttl_s)
    return JSONResponse(answer, headers=_headers([job]))


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


KEEP_ALIVE = "keep-alive"
"""``_deltas``: nothing happened for a while (a streamed answer sends a comment so proxies keep it open)."""
TIMED_OUT = "timed-out"
"""``_deltas``: the job outlasted OMNI_OPENAI_WAIT_S (the last item)."""


async def _deltas(ctx: ApiContext, job: Job) -> AsyncIterator[JobEvent | str]:
    """The job's ``output.delta`` events until its final one, with ``KEEP_ALIVE`` at least every 5 s and at the
    deadline, and ``TIMED_OUT`` (then nothing) once OMNI_OPENAI_WAIT_S has passed: what every streamed answer
    follows. The job as it ended is then ``ctx.watcher.get``'s."""
    wait_s = ctx.runtime.settings.openai_wait_s
    deadline = time.monotonic() + wait_s
    async for event in ctx.watcher.follow(job.id, heartbeat_s=min(5.0, wait_s)):
        if time.monotonic() > deadline:
            yield TIMED_OUT
            return
        if event is None:
            yield KEEP_ALIVE
        elif event.type in FINAL_EVENTS:
            return
        elif event.type == EventType.output_delta:
            yield event


def _timeout_message(ctx: ApiContext, job: Job) -> str:
    return (f"job {job.id} still running after {ctx.runtime.settings.openai_wait_s:g}s (OMNI_OPENAI_WAIT_S); "
            f"follow it at GET /v1/jobs/{job.id}")


def _unsuccessful(job_id: str, final: Job | None) -> tuple[str, str] | None:
    """(message, code) of a job that did not succeed (None: it did), for an error event in a stream."""
    if final is not None and final.status is JobStatus.succeeded:
        return None
    reason = final.error.message if final is not None and final.error else None
    status = final.status.value if final is not None else "gone"
    return f"job {job_id} {status}" + (f": {reason}" if reason else ""), f"job_{status}"


async def _chat_chunks(ctx: ApiContext, plan: Plan, job: Job, *, include_usage: bool) -> AsyncIterator[str]:
    """The chat answer as OpenAI's chunks, from the job's event stream: role, content deltas, the
    finish chunk, the usage chunk (``include_usage``), ``[DONE]``; an error chunk if the job fails.

    The content is the text output's deltas, so their concatenation is the non-streamed answer (a
    later attempt's repeat is skipped by the DeltaReader). Whatever no delta carried (none were
    published, e.g. by an older worker) is sent from the final text before the finish chunk.

    With the audio modality the chunks are OpenAI's streamed speech: ``delta.audio`` with the text as
    ``transcript`` pieces and the speech as ``data`` (base64 24 kHz pcm16) from the audio output's deltas
    (omni_jobs.run.audio_stream: each sample once across a stage's reruns); the audio no delta carried (a stage
    that does not stream) comes from the final clip once the job succeeded; the last ``delta.audio`` holds
    ``expires_at``."""
    spec = plan.spec
    source = text_source(spec)
    reader = DeltaReader(*source) if source is not None else None  # None: speech alone (plan_chat checked)
    speech = audio_source(spec) if "audio" in plan.wanted else None
    sound = AudioDeltaReader(*speech) if speech is not None else None
    audio_id = f"audio_{job.id}"
    base: dict[str, Any] = {"id": f"chatcmpl-{job.id}", "object": "chat.completion.chunk",
                            "created": int(job.created_at), "model": spec.name, "system_fingerprint": None}
    if include_usage:
        base["usage"] = None

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    def said(new: str) -> str:
        return chunk(audio_delta_message(audio_id, transcript=new) if sound is not None else {"content": new})

    def error(status: str, message: str, code: str) -> str:
        return _sse({"error": {"message": message, "type": status, "param": None, "code": code}})

    yield chunk({"role": "assistant", "content": ""})
    async for event in _deltas(ctx, job):
        if event == TIMED_OUT:
            yield error("timeout", _timeout_message(ctx, job), "job_timeout")
            return
        if event == KEEP_ALIVE:
            yield ": keep-alive\n\n"
            continue
        assert isinstance(event, JobEvent)
        if reader is not None and (new := reader.feed(event.data)):
            yield said(new)
        if sound is not None and (piece := sound.feed(event.data)) is not None:
            yield chunk(audio_delta_message(audio_id, data=streamed_pcm(piece)))
    final = await ctx.watcher.get(job.id)
    if (failure := _unsuccessful(job.id, final)) is not None:
        yield error("server_error", *failure)
        return
    assert final is not None  # it succeeded
    text, sent = text_of(final) or "", reader.text if reader is not None else ""
    if len(text) > len(sent) and text.startswith(sent):
        yield said(text[len(sent):])
    if sound is not None:
        try:
            clip = await _speech(ctx, final, first_output(final, "audio"), "pcm")
        except OpenAIError as exc:  # the headers went out: the error as a chunk, as a failed job's
            yield error(exc.type, exc.message, exc.code or "invalid_output")
            return
        for rest in unsent_pcm(clip, sound.handed_out, sound.sample_rate):
            yield chunk(audio_delta_message(audio_id, data=rest))
        expires_at = int(final.completed_at or time.time()) + ctx.runtime.settings.output_ttl_s
        yield chunk(audio_delta_message(audio_id, expires_at=expires_at))
    finish, usage = await _text_meta(ctx, spec, final)
    yield chunk({}, finish)
    if include_usage:
        yield _sse({**base, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


@router.post("/images/generations", summary="OpenAI (DALL-E) image generation, one job per image",
             responses=JOB_ERRORS)
async def images_generations(body: ImageGenerationRequest, request: Request,
                             idempotency_key: IdempotencyKey = None) -> JSONResponse:
    ctx = get_context(request)
    settings = ctx.runtime.settings
    plan = plan_images(ctx.runtime.catalogue, body, max_outputs=settings.max_outputs,
                       aliases=settings.openai_model_aliases)
    keys = [f"{idempotency_key}:{i}" if idempotency_key else None for i in range(len(plan.params))]
    with _wait_place(ctx, request):
        jobs = await _submit_all(ctx, plan, keys, tenant=request.state.tenant, key_id=api_key_id(request))
        jobs = await _finished(ctx, jobs, request, idempotent=idempotency_key is not None)
    items: list[dict[str, Any]] = []
    for job in jobs:
        images = [o for o in job.outputs if o.type == "image"]
        if body.response_format == "url":
            urls = {out.name: await run_in_threadpool(output_url, job, out.name, public_url=settings.public_url,
                                                      artifacts=ctx.runtime.artifacts,
                                                      presign=settings.output_urls == "presigned")
                    for out in images}
            items += image_items(job, body.response_format, urls=urls)
        else:
            items += image_items(job, body.response_format, data={out.name: await _bytes(ctx, out) for out in images})
    return JSONResponse(images_response(jobs, items), headers=_headers(jobs))


_BINARY = {"schema": {"type": "string", "format": "binary"}}


@router.post("/audio/speech", summary="OpenAI text to speech, run as a job (mp3, opus, aac, flac, wav, pcm)",
             response_class=Response,
             responses={200: {"description": "The speech in response_format (default mp3; pcm: raw 24 kHz 16-bit LE "
                              "mono), sent once the job ended.",
                              "content": {**{media_type(f): _BINARY for f in ("mp3", "opus", "aac", "flac", "wav", "pcm")},
                                          "text/event-stream": {}}},
                        **JOB_ERRORS})
async def audio_speech(body: SpeechRequest, request: Request, idempotency_key: IdempotencyKey = None) -> Response:
    ctx = get_context(request)
    plan = plan_speech(ctx.runtime.catalogue, body, aliases=ctx.runtime.settings.openai_model_aliases)
    idempotent = idempotency_key is not None
    live = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    with _wait_place(ctx, request) as place:
        job = await _submit(ctx, plan, plan.params[0], idempotency_key=idempotency_key, tenant=request.state.tenant,
                            key_id=api_key_id(request))
        if plan.sse:
            return StreamingResponse(place.guard(_streamed(ctx, _speech_events(ctx, plan, job), job,
                                                           idempotent=idempotent)),
                                     media_type="text/event-stream", headers={**_headers([job]), **live})
        if plan.audio_format == "pcm" and audio_source(plan.spec) is not None:
            return StreamingResponse(place.guard(_streamed(ctx, _speech_body(ctx, plan, job), job,
                                                           idempotent=idempotent)),
                                     media_type=media_type("pcm"), headers={**_headers([job]), **live})
        (job,) = await _finished(ctx, [job], request, idempotent=idempotent)
    audio = await _speech(ctx, job, first_output(job, "audio"), plan.audio_format)
    return Response(audio, media_type=media_type(plan.audio_format), headers=_headers([job]))


async def _speech_body(ctx: ApiContext, plan: Plan, job: Job) -> AsyncIterator[bytes]:
    """``response_format: "pcm"``: the body is the speech as the job makes it (24 kHz pcm16, each sample once, from
    the audio output's deltas), then what no delta carried from the final clip. The status went out with the first
    byte: a job that fails or outlasts OMNI_OPENAI_WAIT_S ends the body early (the job's URL is in the headers)."""
    source = audio_source(plan.spec)
    assert source is not None
    sound = AudioDeltaReader(*source)
    async for event in _deltas(ctx, job):
        if event == TIMED_OUT:
            return
        if isinstance(event, JobEvent) and (piece := sound.feed(event.data)):
            yield streamed_pcm(piece)
    final = await ctx.watcher.get(job.id)
    if _unsuccessful(job.id, final) is not None:
        return
    assert final is not None  # it succeeded
    data = await _speech(ctx, final, first_output(final, "audio"), "pcm")
    for rest in unsent_pcm(data, sound.handed_out, sound.sample_rate):
        yield rest


SSE_PIECE_BYTES = 64 * 1024
"""A converted file (mp3, opus...) goes out in events of at most this many bytes."""


async def _speech_events(ctx: ApiContext, plan: Plan, job: Job) -> AsyncIterator[str]:
    """``stream_format: "sse"``: ``speech.audio.delta`` events, then ``speech.audio.done``. In ``pcm`` the audio
    output's deltas go out as the job makes them (24 kHz pcm16, each sample once) and what none carried comes
    from the final clip; another format is encoded from the final clip (a file is not cut while it is made),
    in pieces that join to the file. A failed job or the timeout: an ``error`` event."""

    def error(type_: str, message: str, code: str) -> str:
        return _sse({"type": "error", "error": {"message": message, "type": type_, "param": None, "code": code}})

    source = audio_source(plan.spec)
    sound = AudioDeltaReader(*source) if source is not None and plan.audio_format == "pcm" else None
    async for event in _deltas(ctx, job):
        if event == TIMED_OUT:
            yield error("timeout", _timeout_message(ctx, job), "job_timeout")
            return
        if event == KEEP_ALIVE:
            yield ": keep-alive\n\n"
        elif sound is not None and isinstance(event, JobEvent) and (piece := sound.feed(event.data)):
            yield _sse(speech_event("delta", audio=streamed_pcm(piece)))
    final = await ctx.watcher.get(job.id)
    if (failure := _unsuccessful(job.id, final)) is not None:
        yield error("server_error", *failure)
        return
    assert final is not None  # it succeeded
    try:
        data = await _speech(ctx, final, first_output(final, "audio"), plan.audio_format)
    except OpenAIError as exc:
        yield error(exc.type, exc.message, exc.code or "invalid_output")
        return
    pieces = (unsent_pcm(data, sound.handed_out, sound.sample_rate) if sound is not None
              else [data[i:i + SSE_PIECE_BYTES] for i in range(0, len(data), SSE_PIECE_BYTES)])
    for piece_ in pieces:
        yield _sse(speech_event("delta", audio=piece_))
    _finish, usage = await _text_meta(ctx, plan.spec, final)
    yield _sse(speech_event("done", usage=usage))


class TranscriptionSegment(BaseModel):
    id: int
    seek: int = Field(description="The start in Whisper's 10 ms frames.")
    start: float
    end: float
    text: str
    tokens: list[int] = Field(description="Empty: the engine does not report them per segment.")
    temperature: float
    avg_logprob: float = Field(description="0: not measured.")
    compression_ratio: float = Field(description="Whisper's: UTF-8 bytes over zlib-compressed bytes of the text.")
    no_speech_prob: float = Field(description="0: not measured.")


class TranscriptionBody(BaseModel):
    """response_format json: text and usage; verbose_json: every field."""

    text: str
    usage: dict[str, Any] = Field(description="{'type': 'duration', 'seconds': the clip's length}.")
    task: str | None = Field(None, description="verbose_json: transcribe or translate.")
    language: str | None = Field(None, description="verbose_json: the spoken language (ISO 639-1, as given or "
                                 "detected; 'und' when neither).")
    duration: float | None = Field(None, description="verbose_json: the clip's length in seconds.")
    segments: list[TranscriptionSegment] | None = Field(None, description="verbose_json: the timed segments.")


_FORM_PLACEHOLDER = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {"type": "object"}}}}}
_TRANSCRIPTION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": TranscriptionBody,
          "description": "The transcription in response_format: json and verbose_json as JSON, text and srt as "
                         "text/plain, vtt as text/vtt.",
          "content": {"text/plain": {"schema": {"type": "string"}}, "text/vtt": {"schema": {"type": "string"}}}},
    **JOB_ERRORS}


@router.post("/audio/transcriptions", summary="OpenAI speech to text (Whisper), run as a job", response_class=Response,
             openapi_extra=_FORM_PLACEHOLDER, responses=_TRANSCRIPTION_RESPONSES)
async def audio_transcriptions(request: Request, idempotency_key: IdempotencyKey = None) -> Response:
    return await _transcription(request, "transcribe", idempotency_key)


@router.post("/audio/translations", summary="OpenAI speech to English text (Whisper's translate task), run as a job",
             response_class=Response, openapi_extra=_FORM_PLACEHOLDER, responses=_TRANSCRIPTION_RESPONSES)
async def audio_translations(request: Request, idempotency_key: IdempotencyKey = None) -> Response:
    return await _transcription(request, "translate", idempotency_key)


async def _speech_form(request: Request) -> tuple[list[tuple[str, str]], UploadFile | str | None]:
    """The form's text fields, and its file (a file part; a text field named ``file`` is taken as its bytes)."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise OpenAIError(400, f"send multipart/form-data (the audio as the part '{FILE_FIELD}'), not "
                          f"{content_type or 'no content type'!r}", param=FILE_FIELD)
    fields: list[tuple[str, str]] = []
    upload: UploadFile | str | None = None
    for key, value in (await request.form()).multi_items():
        if key == FILE_FIELD:
            if upload is not None:
                raise OpenAIError(400, f"{FILE_FIELD} is given twice", param=FILE_FIELD)
            upload = value
        elif isinstance(value, UploadFile):
            raise OpenAIError(400, f"a file part named {key!r}: the audio is the part '{FILE_FIELD}'", param=key)
        else:
            fields.append((key, value))
    return fields, upload


async def _transcription(request: Request, task: Task, idempotency_key: str | None) -> Response:
    """Submit the job, wait for it, answer its speech stage's document in the format asked."""
    ctx = get_context(request)
    fields, upload = await _speech_form(request)
    form = read_form(fields)
    plan = plan_transcription(ctx.runtime.catalogue, form, task, aliases=ctx.runtime.settings.openai_model_aliases)
    if upload is None:
        raise OpenAIError(400, f"{FILE_FIELD} is required: the audio, as a file part", param=FILE_FIELD)
    assert plan.upload is not None
    limit = plan.spec.inputs[plan.upload].byte_limit
    data = upload.encode() if isinstance(upload, str) else await upload.read(limit + 1)  # one over: refused
    with _wait_place(ctx, request):
        job = await _submit(ctx, plan, plan.params[0], idempotency_key=idempotency_key, tenant=request.state.tenant,
                            key_id=api_key_id(request), input_={**plan.input, plan.upload: data})
        (job,) = await _finished(ctx, [job], request, idempotent=idempotency_key is not None)
    stage_id = plan.spec.stages[0].id
    ref = job.stage_record(stage_id).outputs.get("text")
    try:
        if ref is None:
            raise ValueError(f"stage '{stage_id}' left no text output")
        transcript = read_transcript(codecs.decode_json(await run_in_threadpool(ctx.runtime.artifacts.get, ref)))
    except (ValueError, TypeError, ArtifactError) as exc:  # CodecError is a ValueError
        raise OpenAIError(500, f"job {job.id}: its transcription cannot be read: {exc}", type_="server_error",
                          code="missing_output", job_ids=[job.id], retry=False) from None
    temperature = job.params.get(stage_id, {}).get("temperature", 0.0)
    body, media_type = transcription_answer(transcript, form.response_format,
                                            temperature=float(temperature) if isinstance(temperature, int | float)
                                            else 0.0)
    if isinstance(body, dict):
        return JSONResponse(body, headers=_headers([job]))
    return Response(body, media_type=media_type, headers=_headers([job]))


@router.get("/models", summary="The pipelines, as OpenAI models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(spec, STARTED) for spec in get_context(request).runtime.catalogue]}


@router.get("/models/{model}", summary="One pipeline, as an OpenAI model", responses=_openai_errors(404))
async def get_model(model: str, request: Request) -> dict[str, Any]:
    catalogue = get_context(request).runtime.catalogue
    if model not in catalogue:
        raise OpenAIError(404, f"The model '{model}' does not exist; see GET /v1/models", param="model",
                          code="model_not_found")
    return model_card(catalogue.get(model), STARTED)
