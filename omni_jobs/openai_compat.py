"""OpenAI-compatible requests mapped onto jobs, as pure functions (no HTTP, no I/O).

api/routes/openai.py translates HTTP: it parses a request into one of the models here, asks for its
:class:`Plan` (which pipeline runs, with what input and per-stage params), submits and waits for the
job(s), fetches the output bytes, and hands the finished jobs back here for the answer's body. An
:class:`OpenAIError` is the error in OpenAI's shape; the route turns it into the HTTP answer.

Which pipeline runs: ``model`` when it names a pipeline; otherwise (``gpt-4o``, ``dall-e-3``,
``tts-1``...) one whose declared outputs include every asked modality and whose only required input
is a text prompt, preferring the conventional ``text-to-<modality>`` name, then the fewest other
outputs, built-in before user pipelines, the fewest stages, then the name.

The request models carry, in their JSON schema, what the checks here accept (a pattern, the one
allowed value), so that the OpenAPI spec says it; the checks answer 400 with their own message.
"""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from omni_jobs.checks import is_builtin
from omni_jobs.errors import InvalidRequest
from omni_jobs.jobs.models import Job, JobOutput, JobStatus
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.spec import PipelineSpec, StageSpec

OutputModality = Literal["text", "image", "audio"]


class OpenAIError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {message, type, param, code}}`` with ``status``."""

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

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """X-Omni-Job-Id (the jobs it is about), x-should-retry (OpenAI's clients obey it), Retry-After."""
        headers = {}
        if self.job_ids:
            headers["X-Omni-Job-Id"] = ",".join(self.job_ids)
        if self.retry is not None:
            headers["x-should-retry"] = "true" if self.retry else "false"
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return headers


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


def text_source(spec: PipelineSpec) -> tuple[str, str] | None:
    """(stage, port) behind the pipeline's first text output: whose deltas a chat stream follows."""
    for out in spec.outputs:
        sources = getattr(out, "sources", (out.source,))
        if len(sources) == 1 and spec.stage(out.source.source).outputs.get(out.source.port) == "text":
            return out.source.source, out.source.port
    return None




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



def invalid_request(exc: InvalidRequest, origin: Origin, prompt_param: str) -> OpenAIError:
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


def prompt_from_messages(messages: list[ChatMessageIn]) -> str:
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


# --- plans: what a request runs ---
@dataclass(frozen=True)
class Plan:
    """The job(s) an OpenAI request runs: one per entry of ``params`` (images: ``n``), each with ``input``."""

    spec: PipelineSpec
    input: dict[str, Any]
    params: list[dict[str, dict[str, Any]]]
    origin: Origin = field(default_factory=dict)
    prompt_param: str = "prompt"
    """The OpenAI field the prompt came from, named when the pipeline refuses the input."""
    wanted: list[str] = field(default_factory=lambda: ["text"])
    """Chat: the modalities asked for, one choice each, in order."""


def _prompt_input(spec: PipelineSpec, prompt: str) -> dict[str, Any]:
    name = text_input(spec)
    assert name is not None  # choose_pipeline only picks pipelines that take a text prompt
    return {name: prompt}


def plan_chat(catalogue: PipelineCatalogue, body: ChatCompletionRequest) -> Plan:
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
    spec = choose_pipeline(catalogue, body.model, set(wanted), param="modalities")
    if body.stream and text_source(spec) is None:
        raise OpenAIError(400, f"pipeline '{spec.name}' has no text output to stream", param="stream",
                          code="unsupported_modality")
    prompt = prompt_from_messages(body.messages)
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
    return Plan(spec, _prompt_input(spec, prompt), [params], origin, prompt_param="messages", wanted=wanted)


def plan_images(catalogue: PipelineCatalogue, body: ImageGenerationRequest, *, max_outputs: int) -> Plan:
    """One job per image: ``n`` images, not ``n`` copies (consecutive seeds from the given or default one)."""
    if body.stream:
        raise OpenAIError(400, "stream=true is not supported", param="stream")
    if body.output_format not in (None, "png"):
        raise OpenAIError(400, "output_format must be 'png'", param="output_format")
    if body.n > max_outputs:
        raise OpenAIError(400, f"n is {body.n}; this server makes at most {max_outputs} "
                          "images per call (OMNI_MAX_OUTPUTS)", param="n")
    spec = choose_pipeline(catalogue, body.model, {"image"}, param="model")
    width, height = parse_size(body.size)
    dit = {"num_inference_steps": (body.num_inference_steps, "num_inference_steps"),
           "guidance_scale": (body.guidance_scale, "guidance_scale"),
           "negative_prompt": (body.negative_prompt, "negative_prompt"),
           "width": (width, "size"), "height": (height, "size"), "seed": (body.seed, "seed")}
    params, origin = build_params(spec, {}, dit, body.params)
    per_job: list[dict[str, dict[str, Any]]] = []
    for i in range(body.n):
        job_params = {k: dict(v) for k, v in params.items()}
        if body.n > 1:
            for stage in spec.stages:
                if stage.engine == "dit" and "seed" in _param_fields(stage):
                    base = job_params.get(stage.id, {}).get("seed", stage.defaults.get("seed", 0))
                    job_params.setdefault(stage.id, {})["seed"] = int(base) + i
        per_job.append(job_params)
    return Plan(spec, _prompt_input(spec, body.prompt), per_job, origin, prompt_param="prompt")


def plan_speech(catalogue: PipelineCatalogue, body: SpeechRequest) -> Plan:
    if body.response_format not in (None, "wav"):
        raise OpenAIError(400, f"response_format {body.response_format!r} is not produced; use 'wav'",
                          param="response_format")
    if body.stream_format not in (None, "audio"):
        raise OpenAIError(400, "stream_format must be 'audio' (no SSE streaming)", param="stream_format")
    if body.speed not in (None, 1.0):
        raise OpenAIError(400, "speed must be 1.0", param="speed")
    spec = choose_pipeline(catalogue, body.model, {"audio"}, param="model")
    dit = {"seed": (body.seed, "seed"), "num_inference_steps": (body.num_inference_steps, "num_inference_steps"),
           "guidance_scale": (body.guidance_scale, "guidance_scale"),
           "negative_prompt": (body.negative_prompt, "negative_prompt")}
    params, origin = build_params(spec, {"seed": (body.seed, "seed")}, dit, body.params)
    return Plan(spec, _prompt_input(spec, body.input), [params], origin, prompt_param="input")


# --- finished jobs -> the answer ---
def finished(submitted: list[Job], done: list[Job | None], *, wait_s: float) -> list[Job]:
    """The jobs as they ended (``done``: each one after waiting up to ``wait_s``, None if gone), or the
    first one's failure, cancellation or timeout as an OpenAIError (not retried: it would start a job)."""
    ids = [job.id for job in submitted]
    jobs: list[Job] = []
    for before, job in zip(submitted, done, strict=True):
        if job is None:
            raise OpenAIError(500, f"job {before.id} disappeared (expired?)", type_="server_error",
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
        jobs.append(job)
    return jobs


def outputs_of(job: Job, modality: str) -> list[JobOutput]:
    return [o for o in job.outputs if o.type == modality]


def first_output(job: Job, modality: str) -> JobOutput:
    found = outputs_of(job, modality)
    if not found:
        raise OpenAIError(500, f"job {job.id} succeeded without an {modality} output", type_="server_error",
                          code="missing_output", job_ids=[job.id], retry=False)
    return found[0]


def text_of(job: Job) -> str | None:
    texts = outputs_of(job, "text")
    return texts[0].text if texts else None


def needed_outputs(job: Job, wanted: list[str]) -> list[JobOutput]:
    """The outputs whose bytes a chat answer carries (images, the audio), fetched by the caller."""
    needed = list(outputs_of(job, "image")) if "image" in wanted else []
    if "audio" in wanted:
        needed.append(first_output(job, "audio"))
    return needed


def chat_completion(plan: Plan, job: Job, *, finish: str, usage: dict[str, int] | None,
                    data: Mapping[str, bytes], output_ttl_s: int) -> dict[str, Any]:
    """The chat.completion body: one choice per asked modality. ``data``: output name -> its bytes."""
    text = text_of(job)
    choices: list[dict[str, Any]] = []
    for index, modality in enumerate(plan.wanted):
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if modality == "text":
            message["content"] = text or ""
        elif modality == "image":
            message["content"] = [
                {"type": "image_url",
                 "image_url": {"url": f"data:{out.media_type};base64,{base64.b64encode(data[out.name]).decode('ascii')}"}}
                for out in outputs_of(job, "image")]
        else:
            out = first_output(job, "audio")
            message["audio"] = {
                "id": f"audio_{job.id}",
                "data": base64.b64encode(data[out.name]).decode("ascii"),
                "expires_at": int(job.completed_at or time.time()) + output_ttl_s,
                "transcript": text or "",
            }
        choices.append({"index": index, "message": message, "finish_reason": finish if modality == "text" else "stop",
                        "logprobs": None})
    return {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": int(job.created_at),
            "model": plan.spec.name, "choices": choices, "usage": usage, "system_fingerprint": None}


def image_items(job: Job, response_format: str | None, *, data: Mapping[str, bytes] | None = None,
                urls: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The ``data`` entries of one job's images: ``b64_json`` from ``data`` or ``url`` from ``urls``."""
    revised = text_of(job)
    items: list[dict[str, Any]] = []
    for out in outputs_of(job, "image"):
        item: dict[str, Any] = {}
        if response_format == "url":
            assert urls is not None
            item["url"] = urls[out.name]
        else:
            assert data is not None
            item["b64_json"] = base64.b64encode(data[out.name]).decode("ascii")
        if revised is not None:
            item["revised_prompt"] = revised
        items.append(item)
    return items


def images_response(jobs: list[Job], items: list[dict[str, Any]]) -> dict[str, Any]:
    first = outputs_of(jobs[0], "image")
    size = f"{first[0].width}x{first[0].height}" if first and first[0].width else None
    return {"created": int(jobs[0].created_at), "data": items, "output_format": "png", "size": size}


def model_card(spec: PipelineSpec, created: int) -> dict[str, Any]:
    """A pipeline as an OpenAI model (GET /v1/models)."""
    return {"id": spec.name, "object": "model", "created": created, "owned_by": "omni-jobs",
            "description": spec.description.strip(), "output_modalities": sorted(output_modalities(spec)),
            "stages": [s.id for s in spec.stages]}
