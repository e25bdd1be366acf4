"""OpenAI-compatible endpoints over jobs, so existing OpenAI clients work unchanged.

Each call is an ordinary job (visible in /v1/jobs, Flower and the metrics): it is submitted through
the JobSubmitter, waited on here (the job's event stream, no polling), and its outputs are answered
in OpenAI's shape, the way ``vllm serve --omni`` answers:

- ``POST /v1/chat/completions``: text in; ``modalities`` (default ``["text"]``) picks what comes back,
  one choice per modality: text as ``content``, images as ``content`` parts
  ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``, audio as
  ``message.audio`` ``{id, data (base64 WAV), expires_at, transcript}``.
- ``POST /v1/images/generations`` (DALL-E shape; ``n`` jobs, ``b64_json`` by default as vLLM-Omni
  does, or ``url``); ``POST /v1/audio/speech`` (WAV bytes); ``GET /v1/models`` (the pipelines).

Which pipeline runs: ``model`` when it names a pipeline; otherwise (``gpt-4o``, ``dall-e-3``,
``tts-1``...) one whose declared outputs include every asked modality and whose only required input
is a text prompt, preferring the conventional ``text-to-<modality>`` name, then the fewest other
outputs, built-in before user pipelines, the fewest stages, then the name. The answer's ``model``
says which one ran, and the ``X-Omni-Job-Id`` header names the job(s).

Errors use OpenAI's body ``{"error": {message, type, param, code}}``: 400 names the parameter; a
job that failed answers 500 and one still running after OMNI_OPENAI_WAIT_S answers 504, both with
``x-should-retry: false`` because retrying would start another job.

Chat with ``stream: true`` answers in OpenAI's chunk format while the job runs: the AR stage's
``output.delta`` events become content chunks (omni_jobs.text_stream cuts them); the job's end
gives the chunk with ``finish_reason`` (and, with ``stream_options.include_usage``, the usage
chunk), then ``data: [DONE]``. A job that fails sends an ``{"error": ...}`` chunk, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from collections.abc import AsyncIterator, Iterable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Header, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.auth import api_key_id, authenticate
from api.deps import ApiContext, get_context
from api.schemas import errors
from omni_jobs.artifacts import codecs
from omni_jobs.doctor import is_builtin
from omni_jobs.errors import InvalidRequest, QuotaExceeded
from omni_jobs.jobs.models import FINAL_EVENTS, EventType, Job, JobOutput, JobStatus
from omni_jobs.jobs.view import output_url
from omni_jobs.logs import bind
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.spec import PipelineSpec, StageSpec
from omni_jobs.text_stream import DeltaReader


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
            404: "No such model (pipeline).",
            429: "A tenant quota was reached (`param` names it); retry after Retry-After.",
            500: "The job failed or was canceled (`X-Omni-Job-Id` names it; x-should-retry: false).",
            504: "The job did not end within OMNI_OPENAI_WAIT_S; follow it at GET /v1/jobs/{id} "
                 "(x-should-retry: false)."}
    return {code: {"model": OpenAIErrorBody, "description": text[code]} for code in codes}


# 401 and 503 come from the shared auth and store handlers, in the API's {"detail": ...} shape.
router = APIRouter(prefix="/v1", tags=["openai"], responses=errors(401, 503))
JOB_ERRORS = {**_openai_errors(400, 429, 500, 504), **errors(413)}

OPENAI_PATHS = ("/v1/chat/completions", "/v1/images/generations", "/v1/audio/speech", "/v1/models")
OutputModality = Literal["text", "image", "audio"]
STARTED = int(time.time())


# --- errors in OpenAI's shape ---
class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", job_ids: Iterable[str] = (), retry: bool | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_
        self.job_ids = list(job_ids)
        self.retry = retry

    def response(self) -> JSONResponse:
        headers = {}
        if self.job_ids:
            headers["X-Omni-Job-Id"] = ",".join(self.job_ids)
        if self.retry is not None:
            headers["x-should-retry"] = "true" if self.retry else "false"
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


def _openai_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return exc.response()


async def _validation_error(request: Request, exc: Exception) -> Response:
    """Bad bodies on the OpenAI paths answer 400 in OpenAI's shape; elsewhere FastAPI's 422 stays."""
    assert isinstance(exc, RequestValidationError)
    if not request.url.path.startswith(OPENAI_PATHS):
        return await request_validation_exception_handler(request, exc)
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return OpenAIError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param).response()


async def _http_error(request: Request, exc: Exception) -> Response:
    """A body that cannot be parsed (400) on the OpenAI paths answers in OpenAI's shape too."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400 and request.url.path.startswith(OPENAI_PATHS):
        return OpenAIError(400, str(exc.detail)).response()
    return await http_exception_handler(request, exc)


def install(app: FastAPI) -> None:
    """Add the routes and their error handlers to the API."""
    app.include_router(router, dependencies=[Depends(authenticate)])  # the same bearer key (the client's api_key)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


# --- request bodies (extra fields are allowed: OpenAI's extra_body lands at the top level) ---
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    params: dict[str, dict[str, Any]] | None = Field(
        None, description="Per-stage overrides, as in POST /v1/jobs (applied last), e.g. {'dit': {'seed': 7}}."
    )
    seed: int | None = Field(None, description="Seed of every stage that takes one (the image's seed).")
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None


SIZE_PATTERN = r"^(?:auto|([0-9]{1,9})[xX]([0-9]{1,9}))$"
_SIZE = re.compile(SIZE_PATTERN)
Size = Annotated[str | None, WithJsonSchema({"anyOf": [{"type": "string", "pattern": SIZE_PATTERN}, {"type": "null"}]})]
"""Checked by parse_size (400 with its own message); the stage then checks the numbers (e.g. multiple of 8)."""


def only(value: Any) -> WithJsonSchema:
    """The one value the route accepts besides null: the spec says so; the route answers 400 for
    another, with its own message (a field validator would answer pydantic's)."""
    return WithJsonSchema({"anyOf": [{"enum": [value]}, {"type": "null"}]})


_TEXT = {"type": "string", "pattern": r"\S"}  # some text, not only whitespace
MESSAGE_CONTENT: dict[str, Any] = {"anyOf": [
    _TEXT,
    {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": _TEXT}}},
]}
"""What _prompt_from_messages accepts (it answers 400 naming the message or part otherwise)."""


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Annotated[str | list[dict[str, Any]], WithJsonSchema(MESSAGE_CONTENT)] = Field(
        description="The message's text, or its parts: these endpoints take text parts only.")


class ChatCompletionRequest(_Body):
    model_config = ConfigDict(json_schema_extra={  # what chat_completions checks across fields (else 400)
        "dependentSchemas": {"stream_options": {"required": ["stream"], "properties": {"stream": {"const": True}}}},
        "if": {"required": ["stream"], "properties": {"stream": {"const": True}}},
        "then": {"properties": {"modalities": {"anyOf": [{"type": "array", "items": {"const": "text"}},
                                                         {"type": "null"}]}}}})
    model: str
    messages: list[ChatMessageIn] = Field(min_length=1)
    modalities: list[OutputModality] | None = Field(None, description="What to answer with; default ['text'].")
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(None, ge=1, le=1, description="One choice per modality: n is 1.")
    stream: bool | None = None
    stream_options: dict[str, Any] | None = Field(None, description="{'include_usage': true}: a last chunk "
                                                  "with the usage (stream=true only).")
    audio: Annotated[dict[str, Any] | None, WithJsonSchema(
        {"anyOf": [{"type": "object", "properties": {"format": {"enum": ["wav", None]}}}, {"type": "null"}]})] = Field(
        None, description="{'format': 'wav'}: the only audio format produced.")
    size: Size = Field(None, description="Image size 'WIDTHxHEIGHT' when an image is asked for.")
    height: int | None = None
    width: int | None = None


class ImageGenerationRequest(_Body):
    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(1, ge=1, le=10)
    size: Size = Field(None, description="'WIDTHxHEIGHT' or 'auto' (the pipeline's default).")
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Annotated[str | None, only("png")] = None
    stream: Annotated[bool | None, only(False)] = Field(None, description="Not supported: images come whole.")


class SpeechRequest(_Body):
    model: str
    input: str = Field(min_length=1, max_length=4096)
    voice: str | dict[str, Any] | None = None
    instructions: str | None = None
    response_format: Annotated[str | None, only("wav")] = None
    speed: Annotated[float | None, only(1.0)] = None
    stream_format: Annotated[str | None, only("audio")] = Field(None, description="No SSE streaming.")


# --- choosing the pipeline ---
def output_modalities(spec: PipelineSpec) -> set[str]:
    """Modalities of the pipeline's single-port outputs (what a client can be handed)."""
    found: set[str] = set()
    for out in spec.outputs:
        sources = getattr(out, "sources", (out.source,))
        if len(sources) != 1:
            continue
        found.add(str(spec.stage(out.source.source).outputs[out.source.port]))
    return found


def text_input(spec: PipelineSpec) -> str | None:
    """The input a text prompt goes to, when every other input is optional or has a default."""
    texts = [n for n, f in spec.inputs.items() if f.type == "text"]
    name = "prompt" if "prompt" in texts else (texts[0] if len(texts) == 1 else None)
    if name is None:
        return None
    others_needed = [n for n, f in spec.inputs.items() if n != name and f.required and f.default is None]
    return None if others_needed else name


def choose_pipeline(catalogue: PipelineCatalogue, model: str | None, wanted: set[str], *, param: str) -> PipelineSpec:
    """``model`` when it names a pipeline that gives ``wanted``; else the best match by declared outputs."""
    if model and model in catalogue:
        spec = catalogue.get(model)
        missing = wanted - output_modalities(spec)
        if missing:
            raise OpenAIError(400, f"pipeline '{model}' outputs {sorted(output_modalities(spec))}, not "
                              f"{sorted(missing)}; pick a pipeline from GET /v1/models", param=param,
                              code="unsupported_modality")
        if text_input(spec) is None:
            raise OpenAIError(400, f"pipeline '{model}' needs inputs {sorted(spec.inputs)}; these endpoints send "
                              "only a text prompt (use POST /v1/jobs)", param="model", code="unsupported_pipeline")
        return spec
    candidates = [s for s in catalogue if wanted <= output_modalities(s) and text_input(s) is not None]
    if not candidates:
        raise OpenAIError(400, f"no pipeline takes a text prompt and outputs {sorted(wanted)}; available: "
                          f"{catalogue.names()}", param=param, code="unsupported_modality")
    conventional = {f"text-to-{m}" for m in wanted}  # text-to-image for images, text-to-audio for speech...
    return min(candidates, key=lambda s: (s.name not in conventional, len(output_modalities(s) - wanted),
                                          not is_builtin(s), len(s.stages), s.name))


# --- parameters ---
Origin = dict[tuple[str, str], str]
"""(stage id, parameter) -> the OpenAI field it came from, to name that field in errors."""


def _param_fields(stage: StageSpec) -> set[str]:
    model = getattr(stage, "params_model", None)
    if model is None:
        from omni_jobs.pipelines.params import params_model

        model = params_model(stage.engine)
    return set(model.model_fields)


def build_params(spec: PipelineSpec, ar: dict[str, tuple[Any, str]], dit: dict[str, tuple[Any, str]],
                 explicit: dict[str, dict[str, Any]] | None) -> tuple[dict[str, dict[str, Any]], Origin]:
    """Per-stage params from OpenAI fields: sampling to AR stages, generation to DiT stages, each only
    where the stage takes it. A field given but taken by no stage is an error naming it."""
    params: dict[str, dict[str, Any]] = {}
    origin: Origin = {}
    used: set[str] = set()
    for stage in spec.stages:
        fields = _param_fields(stage)
        for key, (value, source) in (ar if stage.engine == "ar" else dit).items():
            if value is not None and key in fields:
                params.setdefault(stage.id, {})[key] = value
                origin[(stage.id, key)] = source
                used.add(source)
    given = {source for value, source in [*ar.values(), *dit.values()] if value is not None}
    unused = sorted(given - used)
    if unused:
        raise OpenAIError(400, f"pipeline '{spec.name}' has no stage that takes '{unused[0]}'", param=unused[0],
                          code="unsupported_parameter")
    for stage_id, overrides in (explicit or {}).items():
        params.setdefault(stage_id, {}).update(overrides)
    return params, origin


def parse_size(size: str | None, *, param: str = "size") -> tuple[int | None, int | None]:
    """'WIDTHxHEIGHT' -> (width, height); None or 'auto' -> the pipeline's default."""
    if size is None or size == "auto":
        return None, None
    match = _SIZE.match(size)
    if match is None:
        raise OpenAIError(400, f"size must be 'WIDTHxHEIGHT' (e.g. '64x64') or 'auto', got {size!r}", param=param)
    return int(match[1]), int(match[2])



def _invalid(exc: InvalidRequest, origin: Origin, prompt_param: str) -> OpenAIError:
    error = exc.errors[0]
    loc = tuple(str(p) for p in error.loc)
    if loc[:1] == ("input",):
        param = prompt_param
    elif loc[:1] == ("params",) and len(loc) >= 3:
        param = origin.get((loc[1], loc[2]), ".".join(loc))
    else:
        param = ".".join(loc)
    messages = "; ".join(f"{'.'.join(map(str, e.loc))}: {e.message}" for e in exc.errors)
    return OpenAIError(400, f"{param}: {error.message} ({messages})", param=param, code=error.type)


# --- jobs ---
async def _submit(ctx: ApiContext, spec: PipelineSpec, prompt: str, params: dict[str, dict[str, Any]],
                  origin: Origin, *, prompt_param: str, idempotency_key: str | None, tenant: str,
                  key_id: str | None = None) -> Job:
    name = text_input(spec)
    assert name is not None
    try:
        job: Job = await run_in_threadpool(ctx.submitter.submit, spec.name, {name: prompt}, params,
                                           idempotency_key=idempotency_key, tenant=tenant, api_key_id=key_id)
    except InvalidRequest as exc:
        raise _invalid(exc, origin, prompt_param) from None
    except QuotaExceeded as exc:  # OpenAI's clients back off and retry a 429 by themselves
        raise OpenAIError(429, str(exc), code="rate_limit_exceeded", type_="requests", param=exc.limit,
                          retry_after_s=exc.retry_after_s) from None
    bind(job_id=job.id)  # the access log line and anything logged below name the job
    return job


async def _finished(ctx: ApiContext, jobs: list[Job]) -> list[Job]:
    """Wait for every job to end; answer their failure or the timeout in OpenAI's shape."""
    wait_s = ctx.runtime.settings.openai_wait_s
    done = await asyncio.gather(*(ctx.watcher.wait_final(job.id, wait_s) for job in jobs))
    ids = [job.id for job in jobs]
    finished: list[Job] = []
    for submitted, job in zip(jobs, done, strict=True):
        if job is None:
            raise OpenAIError(500, f"job {submitted.id} disappeared (expired?)", type_="server_error",
                              code="job_gone", job_ids=ids, retry=False)
        if job.status is JobStatus.failed:
            error = job.error
            where = f" in stage '{error.stage}'" if error and error.stage else ""
            raise OpenAIError(500, f"job {job.id} failed{where}: {error.message if error else 'unknown error'}",
                              type_="server_error", code="job_failed", job_ids=ids, retry=False)
        if job.status is JobStatus.canceled:
            raise OpenAIError(500, f"job {job.id} was canceled", type_="server_error", code="job_canceled",
                              job_ids=ids, retry=False)
        if not job.status.is_final:
            raise OpenAIError(504, f"job {job.id} is still {job.status.value} after {wait_s:g}s (OMNI_OPENAI_WAIT_S); "
                              f"follow it at GET /v1/jobs/{job.id}", type_="timeout", code="job_timeout",
                              job_ids=ids, retry=False)
        finished.append(job)
    return finished


def _outputs(job: Job, modality: str) -> list[JobOutput]:
    return [o for o in job.outputs if o.type == modality]


def _first(job: Job, modality: str) -> JobOutput:
    found = _outputs(job, modality)
    if not found:
        raise OpenAIError(500, f"job {job.id} succeeded without an {modality} output", type_="server_error",
                          code="missing_output", job_ids=[job.id], retry=False)
    return found[0]


async def _bytes(ctx: ApiContext, output: JobOutput) -> bytes:
    data: bytes = await run_in_threadpool(ctx.runtime.artifacts.get, output.artifact)
    return data


def _text(job: Job) -> str | None:
    texts = _outputs(job, "text")
    return texts[0].text if texts else None


def text_source(spec: PipelineSpec) -> tuple[str, str] | None:
    """(stage, port) behind the pipeline's first text output: whose deltas a chat stream follows."""
    for out in spec.outputs:
        sources = getattr(out, "sources", (out.source,))
        if len(sources) == 1 and spec.stage(out.source.source).outputs.get(out.source.port) == "text":
            return out.source.source, out.source.port
    return None


async def _text_meta(ctx: ApiContext, spec: PipelineSpec, job: Job) -> tuple[str, dict[str, int] | None]:
    """(finish_reason, usage) of the text answer, as the AR engine reported them beside its text.

    A stage output written before the engine reported them (kept in the stage cache) has neither:
    then 'length' when the stage made max_tokens tokens, else 'stop', and no usage."""
    source = text_source(spec)
    if source is None:
        return "stop", None
    stage_id, port = source
    ref = job.stage_record(stage_id).outputs.get(port)
    if ref is None:
        return "stop", None
    document = codecs.decode_json(await run_in_threadpool(ctx.runtime.artifacts.get, ref))
    usage = document.get("usage")
    if isinstance(usage, dict):
        usage = {"prompt_tokens": int(usage["prompt_tokens"]), "completion_tokens": int(usage["completion_tokens"]),
                 "total_tokens": int(usage["prompt_tokens"]) + int(usage["completion_tokens"])}
    finish = document.get("finish_reason")
    if isinstance(finish, str):
        return finish, usage
    tokens_ref = job.stage_record(stage_id).outputs.get("token_ids")
    max_tokens = job.params.get(stage_id, {}).get("max_tokens")
    if tokens_ref is None or max_tokens is None:
        return "stop", usage
    from omni_jobs.payloads import decode_payload

    tokens = decode_payload("token_ids", await run_in_threadpool(ctx.runtime.artifacts.get, tokens_ref))
    return ("length" if len(tokens) >= int(max_tokens) else "stop"), usage


def _headers(jobs: list[Job]) -> dict[str, str]:
    return {"X-Omni-Job-Id": ",".join(j.id for j in jobs)}


def _prompt_from_messages(messages: list[ChatMessageIn]) -> str:
    """One message: its text. Several: a transcript ('User: ...', 'Assistant: ...') ending with 'Assistant:'."""
    turns: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, str):
            text = content
        else:
            if not content:
                raise OpenAIError(400, "content has no parts", param=f"messages[{i}].content")
            parts = []
            for j, part in enumerate(content):
                if part.get("type") != "text":
                    raise OpenAIError(400, f"content part of type {part.get('type')!r}: these endpoints take text "
                                      "only (send images to an image-input pipeline with POST /v1/jobs)",
                                      param=f"messages[{i}].content[{j}]", code="unsupported_content")
                part_text = part.get("text")
                if not isinstance(part_text, str) or not part_text.strip():
                    raise OpenAIError(400, "a text part holds no text", param=f"messages[{i}].content[{j}].text")
                parts.append(part_text)
            text = "\n".join(parts)
        if not text.strip():
            raise OpenAIError(400, "the message holds no text", param=f"messages[{i}].content")
        turns.append((message.role, text))
    if len(turns) == 1:
        return turns[0][1]
    lines = [f"{role.capitalize()}: {text}" for role, text in turns]
    return "\n".join([*lines, "Assistant:"])


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
    if body.n not in (None, 1):
        raise OpenAIError(400, "n must be 1 (send several requests; each is a job)", param="n")
    if body.audio and body.audio.get("format") not in (None, "wav"):
        raise OpenAIError(400, "audio.format must be 'wav'", param="audio.format")
    wanted = list(dict.fromkeys(body.modalities or ["text"]))
    if body.stream and wanted != ["text"]:
        raise OpenAIError(400, "stream=true streams text: ask modalities ['text'] (images and audio come whole; "
                          "follow GET /v1/jobs/{id}/events for a job's previews)", param="stream")
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    spec = choose_pipeline(ctx.runtime.catalogue, body.model, set(wanted), param="modalities")
    if body.stream and text_source(spec) is None:
        raise OpenAIError(400, f"pipeline '{spec.name}' has no text output to stream", param="stream",
                          code="unsupported_modality")
    prompt = _prompt_from_messages(body.messages)
    width, height = parse_size(body.size)
    ar = {"max_tokens": (body.max_completion_tokens or body.max_tokens,
                         "max_completion_tokens" if body.max_completion_tokens else "max_tokens"),
          "temperature": (body.temperature, "temperature"), "top_p": (body.top_p, "top_p"),
          "seed": (body.seed, "seed")}
    dit = {"seed": (body.seed, "seed"), "num_inference_steps": (body.num_inference_steps, "num_inference_steps"),
           "guidance_scale": (body.guidance_scale, "guidance_scale"),
           "negative_prompt": (body.negative_prompt, "negative_prompt"),
           "width": (body.width or width, "width" if body.width else "size"),
           "height": (body.height or height, "height" if body.height else "size")}
    params, origin = build_params(spec, ar, dit, body.params)
    job = await _submit(ctx, spec, prompt, params, origin, prompt_param="messages", idempotency_key=idempotency_key,
                        tenant=request.state.tenant, key_id=api_key_id(request))
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(_chat_chunks(ctx, spec, job, include_usage=include_usage),
                                 media_type="text/event-stream",
                                 headers={**_headers([job]), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    (job,) = await _finished(ctx, [job])
    finish, usage = await _text_meta(ctx, spec, job)

    text = _text(job)
    choices: list[dict[str, Any]] = []
    for index, modality in enumerate(wanted):
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if modality == "text":
            message["content"] = text or ""
        elif modality == "image":
            parts = []
            for out in _outputs(job, "image"):
                data = base64.b64encode(await _bytes(ctx, out)).decode("ascii")
                parts.append({"type": "image_url", "image_url": {"url": f"data:{out.media_type};base64,{data}"}})
            message["content"] = parts
        else:
            out = _first(job, "audio")
            message["audio"] = {
                "id": f"audio_{job.id}",
                "data": base64.b64encode(await _bytes(ctx, out)).decode("ascii"),
                "expires_at": int(job.completed_at or time.time()) + ctx.runtime.settings.output_ttl_s,
                "transcript": text or "",
            }
        choices.append({"index": index, "message": message, "finish_reason": finish if modality == "text" else "stop",
                        "logprobs": None})
    answer = {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": int(job.created_at),
              "model": spec.name, "choices": choices, "usage": usage, "system_fingerprint": None}
    return JSONResponse(answer, headers=_headers([job]))


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _chat_chunks(ctx: ApiContext, spec: PipelineSpec, job: Job, *, include_usage: bool) -> AsyncIterator[str]:
    """The chat answer as OpenAI's chunks, from the job's event stream: role, content deltas, the
    finish chunk, the usage chunk (``include_usage``), ``[DONE]``; an error chunk if the job fails.

    The content is the text output's deltas, so their concatenation is the non-streamed answer (a
    later attempt's repeat is skipped by the DeltaReader). Whatever no delta carried (none were
    published, e.g. by an older worker) is sent from the final text before the finish chunk."""
    source = text_source(spec)
    assert source is not None
    reader = DeltaReader(*source)
    base: dict[str, Any] = {"id": f"chatcmpl-{job.id}", "object": "chat.completion.chunk",
                            "created": int(job.created_at), "model": spec.name, "system_fingerprint": None}
    if include_usage:
        base["usage"] = None

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    def error(status: str, message: str, code: str) -> str:
        return _sse({"error": {"message": message, "type": status, "param": None, "code": code}})

    yield chunk({"role": "assistant", "content": ""})
    deadline = time.monotonic() + ctx.runtime.settings.openai_wait_s
    async for event in ctx.watcher.follow(job.id, heartbeat_s=5.0):
        if time.monotonic() > deadline:
            yield error("timeout", f"job {job.id} still running after {ctx.runtime.settings.openai_wait_s:g}s "
                        f"(OMNI_OPENAI_WAIT_S); follow it at GET /v1/jobs/{job.id}", "job_timeout")
            return
        if event is None:
            yield ": keep-alive\n\n"
            continue
        if event.type in FINAL_EVENTS:
            break
        new = reader.feed(event.data) if event.type == EventType.output_delta else ""
        if new:
            yield chunk({"content": new})
    final = await ctx.watcher.get(job.id)
    if final is None or final.status is not JobStatus.succeeded:
        reason = (final.error.message if final is not None and final.error else None)
        status = final.status.value if final is not None else "gone"
        yield error("server_error", f"job {job.id} {status}" + (f": {reason}" if reason else ""), f"job_{status}")
        return
    text, sent = _text(final) or "", reader.text
    if len(text) > len(sent) and text.startswith(sent):
        yield chunk({"content": text[len(sent):]})
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
    if body.stream:
        raise OpenAIError(400, "stream=true is not supported", param="stream")
    if body.output_format not in (None, "png"):
        raise OpenAIError(400, "output_format must be 'png'", param="output_format")
    if body.n > ctx.runtime.settings.max_outputs:
        raise OpenAIError(400, f"n is {body.n}; this server makes at most {ctx.runtime.settings.max_outputs} "
                          "images per call (OMNI_MAX_OUTPUTS)", param="n")
    spec = choose_pipeline(ctx.runtime.catalogue, body.model, {"image"}, param="model")
    width, height = parse_size(body.size)
    dit = {"num_inference_steps": (body.num_inference_steps, "num_inference_steps"),
           "guidance_scale": (body.guidance_scale, "guidance_scale"),
           "negative_prompt": (body.negative_prompt, "negative_prompt"),
           "width": (width, "size"), "height": (height, "size"), "seed": (body.seed, "seed")}
    params, origin = build_params(spec, {}, dit, body.params)
    jobs: list[Job] = []
    for i in range(body.n):
        job_params = {k: dict(v) for k, v in params.items()}
        if body.n > 1:  # n images, not n copies: consecutive seeds from the given (or default) one
            for stage in spec.stages:
                if stage.engine == "dit" and "seed" in _param_fields(stage):
                    base = job_params.get(stage.id, {}).get("seed", stage.defaults.get("seed", 0))
                    job_params.setdefault(stage.id, {})["seed"] = int(base) + i
        key = f"{idempotency_key}:{i}" if idempotency_key else None
        jobs.append(await _submit(ctx, spec, body.prompt, job_params, origin, prompt_param="prompt",
                                  idempotency_key=key, tenant=request.state.tenant, key_id=api_key_id(request)))
    jobs = await _finished(ctx, jobs)
    settings = ctx.runtime.settings
    data: list[dict[str, Any]] = []
    for job in jobs:
        revised = _text(job)
        for out in _outputs(job, "image"):
            item: dict[str, Any] = {}
            if body.response_format == "url":
                item["url"] = await run_in_threadpool(output_url, job, out.name, public_url=settings.public_url,
                                                      artifacts=ctx.runtime.artifacts,
                                                      presign=settings.output_urls == "presigned")
            else:
                item["b64_json"] = base64.b64encode(await _bytes(ctx, out)).decode("ascii")
            if revised is not None:
                item["revised_prompt"] = revised
            data.append(item)
    first = _outputs(jobs[0], "image")
    size = f"{first[0].width}x{first[0].height}" if first and first[0].width else None
    answer = {"created": int(jobs[0].created_at), "data": data, "output_format": "png", "size": size}
    return JSONResponse(answer, headers=_headers(jobs))


@router.post("/audio/speech", summary="OpenAI text to speech, run as a job (WAV)", response_class=Response,
             responses={200: {"description": "The speech as WAV.",
                              "content": {"audio/wav": {"schema": {"type": "string", "format": "binary"}}}},
                        **JOB_ERRORS})
async def audio_speech(body: SpeechRequest, request: Request, idempotency_key: IdempotencyKey = None) -> Response:
    ctx = get_context(request)
    if body.response_format not in (None, "wav"):
        raise OpenAIError(400, f"response_format {body.response_format!r} is not produced; use 'wav'",
                          param="response_format")
    if body.stream_format not in (None, "audio"):
        raise OpenAIError(400, "stream_format must be 'audio' (no SSE streaming)", param="stream_format")
    if body.speed not in (None, 1.0):
        raise OpenAIError(400, "speed must be 1.0", param="speed")
    spec = choose_pipeline(ctx.runtime.catalogue, body.model, {"audio"}, param="model")
    dit = {"seed": (body.seed, "seed"), "num_inference_steps": (body.num_inference_steps, "num_inference_steps"),
           "guidance_scale": (body.guidance_scale, "guidance_scale"),
           "negative_prompt": (body.negative_prompt, "negative_prompt")}
    params, origin = build_params(spec, {"seed": (body.seed, "seed")}, dit, body.params)
    job = await _submit(ctx, spec, body.input, params, origin, prompt_param="input", idempotency_key=idempotency_key,
                        tenant=request.state.tenant, key_id=api_key_id(request))
    (job,) = await _finished(ctx, [job])
    out = _first(job, "audio")
    return Response(await _bytes(ctx, out), media_type=out.media_type, headers=_headers([job]))


def _model(spec: PipelineSpec) -> dict[str, Any]:
    return {"id": spec.name, "object": "model", "created": STARTED, "owned_by": "omni-jobs",
            "description": spec.description.strip(), "output_modalities": sorted(output_modalities(spec)),
            "stages": [s.id for s in spec.stages]}


@router.get("/models", summary="The pipelines, as OpenAI models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model(spec) for spec in get_context(request).runtime.catalogue]}


@router.get("/models/{model}", summary="One pipeline, as an OpenAI model", responses=_openai_errors(404))
async def get_model(model: str, request: Request) -> dict[str, Any]:
    catalogue = get_context(request).runtime.catalogue
    if model not in catalogue:
        raise OpenAIError(404, f"The model '{model}' does not exist; see GET /v1/models", param="model",
                          code="model_not_found")
    return _model(catalogue.get(model))

