"""OpenAI-compatible requests mapped onto jobs, as pure functions (no HTTP, no I/O).

api/routes/openai.py translates HTTP: it parses a request into one of the models here, asks for its
:class:`Plan` (which pipeline runs, with what input and per-stage params), submits and waits for the
job(s), fetches the output bytes, and hands the finished jobs back here for the answer's body. An
:class:`OpenAIError` is the error in OpenAI's shape; the route turns it into the HTTP answer.

Which pipeline runs: ``model`` when it names a pipeline; for no model or one of OpenAI's names
(``gpt-4o``, ``dall-e-3``, ``tts-1``...: OMNI_OPENAI_MODEL_ALIASES), one whose declared outputs include every asked modality and whose inputs a request
fills: a text prompt, and for chat the kinds of media its messages hold (omni_jobs.openai_content),
preferring the conventional ``<input>-to-<modality>`` name (``text-to-image``; ``image-to-text`` for
a chat with images), then the fewest other outputs, answers before transcripts, the fewest media
inputs left empty, built-in before user pipelines, the fewest stages, then the name. Any other
name is OpenAI's 404 ``model_not_found`` (omni_jobs.openai_models): a typo is not served by another model.

Which stage parameter each OpenAI field sets is a table (CHAT_FIELDS, IMAGE_FIELDS, SPEECH_FIELDS).
The request models carry, in their JSON schema, what the checks here accept (a pattern, the one
allowed value); request_schema adds, from the same tables and the same pipeline choice, one
schema per pipeline a request can run with what its stages take, so that the OpenAPI spec says
it. The checks answer 400 with their own message.
"""

from __future__ import annotations

import base64
import itertools
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Literal, TypeAlias

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator

from omni_jobs.artifacts.codecs import CodecError
from omni_jobs.artifacts.refs import ArtifactRef
from omni_jobs.audio_formats import AUDIO_FORMATS, PCM_RATE, AudioFormat, check_format, pcm16
from omni_jobs.audio_stream import AudioChunk
from omni_jobs.checks import is_builtin
from omni_jobs.errors import InvalidRequest
from omni_jobs.jobs.models import Job, JobOutput, JobStatus
from omni_jobs.json_types import JsonObject, JsonScalar, JsonValue
from omni_jobs.limits import Limits
from omni_jobs.openai_content import (
    FILE_KINDS,
    KIND_PARTS,
    ChatContent,
    ChatMessageIn,
    ContentInputs,
    MediaPart,
    a_kind,
    content_inputs,
    first_misfit,
    media_input,
    messages_schema,
    missing_kinds,
    read_content,
)
from omni_jobs.openai_errors import OpenAIError
from omni_jobs.openai_models import OPENAI_MODEL_NAMES, by_request
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.modalities import EngineKind
from omni_jobs.pipelines.params import SEED_MAX, whole_numbers
from omni_jobs.pipelines.schema import NOT_BLANK, input_field_schema, json_object, params_schema, stage_params_schema
from omni_jobs.pipelines.spec import InputField, PipelineSpec, StageSpec

OutputModality = Literal["text", "image", "audio"]
StageOverrides: TypeAlias = dict[str, dict[str, JsonValue]]
"""Per-stage parameter overrides, as a request gives them (the submitter validates them)."""


# --- request bodies (extra fields are allowed: OpenAI's extra_body lands at the top level) ---
class _Body(BaseModel):
    """Strict: a value is taken as its schema types it (no "7" or true for an integer, no "0.5" for a
    number; 7.0 is an integer, as in JSON Schema). OpenAI's clients send JSON numbers: not refused."""

    model_config = ConfigDict(extra="allow", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _whole_numbers(cls, value: object, info: ValidationInfo) -> object:
        return whole_numbers(cls, value, info.field_name)

    params: StageOverrides | None = Field(
        None, description="Per-stage overrides, as in POST /v1/jobs (applied last), e.g. {'dit': {'seed': 7}}."
    )
    seed: int | None = Field(None, description="Seed of every stage that takes one (the image's seed).")
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None


SIZE_PATTERN = r"^(?:auto|([1-9][0-9]{0,8})[xX]([1-9][0-9]{0,8}))$"
_SIZE = re.compile(SIZE_PATTERN)
Size = Annotated[str | None, WithJsonSchema({"anyOf": [{"type": "string", "pattern": SIZE_PATTERN}, {"type": "null"}]})]
"""Checked by parse_size (400 with its own message); the stage then checks the numbers (e.g. multiple of 8)."""


def only(value: JsonScalar) -> WithJsonSchema:
    """The one value the route accepts besides null: the spec says so; the route answers 400 for
    another, with its own message (a field validator would answer pydantic's)."""
    return WithJsonSchema({"anyOf": [{"enum": [value]}, {"type": "null"}]})


CHAT_AUDIO_FORMATS = ("wav", "mp3", "flac", "opus", "aac", "pcm16")
"""A chat's ``audio.format`` (OpenAI's names: ``pcm16`` is omni_jobs.audio_formats' ``pcm``); streamed, only
``pcm16``, as OpenAI streams audio."""
STREAMED_AUDIO_FORMAT = "pcm16"
VOICE_INPUT = "voice"
"""The pipeline input that OpenAI's ``voice`` (speech) and ``audio.voice`` (chat) set, where a pipeline has one."""
VOICE_SCHEMA: JsonObject = {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"id": {"type": "string"}},
                                                                   "required": ["id"]}, {"type": "null"}]}


class ChatCompletionRequest(_Body):
    model_config = ConfigDict(json_schema_extra={  # what chat_completions checks across fields (else 400)
        "dependentSchemas": {"stream_options": {"required": ["stream"], "properties": {"stream": {"const": True}}}},
        "if": {"required": ["stream"], "properties": {"stream": {"const": True}}},
        "then": {"properties": {"modalities": {"anyOf": [{"type": "array", "items": {"enum": ["text", "audio"]}},
                                                         {"type": "null"}]}},
                 "anyOf": [  # text alone, or streamed speech in pcm16 (OpenAI's rule)
                     {"properties": {"modalities": {"anyOf": [{"type": "array", "items": {"const": "text"}},
                                                              {"type": "null"}]}}},
                     {"properties": {"audio": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
                         "format": {"enum": [STREAMED_AUDIO_FORMAT, None]}}}]}}}]}})
    model: str
    messages: list[ChatMessageIn] = Field(min_length=1)
    modalities: list[OutputModality] | None = Field(None, description="What to answer with; default ['text'].")
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(None, ge=1, le=1, description="One choice per modality: n is 1.")
    stream: bool | None = None
    stream_options: JsonObject | None = Field(None, description="{'include_usage': true}: a last chunk "
                                                  "with the usage (stream=true only).")
    audio: Annotated[JsonObject | None, WithJsonSchema(
        {"anyOf": [{"type": "object", "properties": {"format": {"enum": [*CHAT_AUDIO_FORMATS, None]},
                                                      "voice": VOICE_SCHEMA}}, {"type": "null"}]})] = Field(
        None, description="{'voice', 'format'}: the speech's voice (the pipeline's voice input) and format "
        f"({', '.join(CHAT_AUDIO_FORMATS)}; default wav; streamed: pcm16).")
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
    voice: str | JsonObject | None = Field(None, description="The pipeline's voice input where it has one (one of "
                                           "its voices, or {'id': voice}); ignored by a pipeline without one.")
    instructions: str | None = None
    response_format: Annotated[str | None, WithJsonSchema({"anyOf": [{"enum": [*AUDIO_FORMATS]}, {"type": "null"}]})] = \
        Field(None, description=f"{', '.join(AUDIO_FORMATS)} (default mp3, as OpenAI's; pcm: 24 kHz 16-bit LE mono).")
    speed: Annotated[float | None, only(1.0)] = None
    stream_format: Annotated[str | None, WithJsonSchema({"anyOf": [{"enum": ["audio", "sse"]}, {"type": "null"}]})] = \
        Field(None, description="audio (default): the file as the body; sse: speech.audio.delta events (pcm: as the "
              "job makes it) and speech.audio.done.")


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
    inputs = content_inputs(spec)
    return inputs.text if inputs is not None and not any(inputs.required.values()) else None


def transcription_stage(spec: PipelineSpec) -> StageSpec | None:
    """The pipeline's first stage when it is a speech-to-text one (an AR ``transcribe`` task)."""
    first = spec.stages[0]
    return first if first.engine == "ar" and first.task_name == "transcribe" else None


def fills(inputs: ContentInputs | None, kinds: frozenset[str]) -> bool:
    """Whether a request with media of ``kinds`` (and a prompt) fills these inputs: it has an input of
    each kind, and the request has each kind the pipeline needs."""
    return (inputs is not None and kinds <= inputs.kinds
            and all(kind in kinds for kind, n in inputs.required.items() if n))


def _chat_candidates(catalogue: PipelineCatalogue, wanted: set[str], kinds: frozenset[str]) -> list[PipelineSpec]:
    return [s for s in catalogue if wanted <= output_modalities(s) and fills(content_inputs(s), kinds)]


def _best(candidates: list[PipelineSpec], wanted: set[str], kinds: frozenset[str]) -> PipelineSpec:
    """The preferred candidate (the module's docstring says the order)."""
    source = "text" if not kinds else (next(iter(kinds)) if len(kinds) == 1 else None)
    conventional = {f"{source}-to-{m}" for m in wanted} if source else set()  # text-to-image, image-to-text...

    def unused(spec: PipelineSpec) -> int:
        inputs = content_inputs(spec)
        return len(inputs.kinds - kinds) if inputs is not None else 0

    return min(candidates, key=lambda s: (s.name not in conventional, len(output_modalities(s) - wanted),
                                          transcription_stage(s) is not None, unused(s), not is_builtin(s),
                                          len(s.stages), s.name))


def takers(catalogue: PipelineCatalogue, wanted: set[str], kind: str, count: int = 1) -> list[str]:
    """The pipelines that take ``count`` parts of ``kind`` in a chat and output ``wanted``."""
    return [s.name for s in catalogue if wanted <= output_modalities(s)
            and (inputs := content_inputs(s)) is not None and len(inputs.slots.get(kind, ())) >= count]


def _refused_part(catalogue: PipelineCatalogue, wanted: set[str], part: MediaPart, count: int,
                  spec: PipelineSpec | None) -> OpenAIError:
    """The 400 for a part that ``spec`` (None: any pipeline that outputs ``wanted``) cannot take, with
    the models that take it."""
    names = takers(catalogue, wanted, part.kind, count)
    which = f"models that take {'it' if count == 1 else f'{count} {part.kind} parts'}: {', '.join(names)}" if names \
        else f"no model that outputs {sorted(wanted)} takes {'one' if count == 1 else count}"
    inputs = content_inputs(spec) if spec is not None else None
    if spec is None or inputs is None:
        what = f"no pipeline that outputs {sorted(wanted)} takes {a_kind(part.kind)} part beside the parts before it"
    else:
        have = len(inputs.slots.get(part.kind, ()))
        what = (f"pipeline '{spec.name}' takes no {part.kind} input" if not have else
                f"pipeline '{spec.name}' takes {have} {part.kind} input{'s' if have > 1 else ''}, and this is "
                f"{part.kind} part {count}")
    return OpenAIError(400, f"{part.param} is {a_kind(part.kind)} part ({part.part_type}): {what}; {which} "
                       "(GET /v1/models)", param=part.param, code="unsupported_content")


def choose_pipeline(catalogue: PipelineCatalogue, model: str | None, wanted: set[str], *, param: str,
                    content: ChatContent | None = None, aliases: Collection[str] = OPENAI_MODEL_NAMES) -> PipelineSpec:
    """``model`` when it names a pipeline that gives ``wanted``; for no model or one of OpenAI's names
    (``aliases``), the best match by declared outputs and, for a chat (``content``), by the kinds of media
    its messages hold; any other name is 404 model_not_found (omni_jobs.openai_models). Whether the chosen
    pipeline takes each part, and how many, plan_chat checks (naming the part)."""
    kinds = content.kinds if content is not None else frozenset()
    if model is not None and not by_request(model, catalogue.names(), aliases):
        spec = catalogue.get(model)
        missing = wanted - output_modalities(spec)
        if missing:
            raise OpenAIError(400, f"pipeline '{model}' outputs {sorted(output_modalities(spec))}, not "
                              f"{sorted(missing)}; pick a pipeline from GET /v1/models", param=param,
                              code="unsupported_modality")
        inputs = content_inputs(spec)
        if inputs is None or (content is None and any(inputs.required.values())):
            sent = "a text prompt and media parts" if content is not None else "only a text prompt"
            raise OpenAIError(400, f"pipeline '{model}' needs inputs {sorted(spec.inputs)}; these endpoints send "
                              f"{sent} (use POST /v1/jobs)", param="model", code="unsupported_pipeline")
        return spec
    candidates = _chat_candidates(catalogue, wanted, kinds)
    if candidates:
        return _best(candidates, wanted, kinds)
    if content is not None and kinds:
        seen: list[MediaPart] = []
        for part in content.media:  # the first part no pipeline takes with the ones before it
            seen.append(part)
            so_far = frozenset(p.kind for p in seen)
            if not any(wanted <= output_modalities(s) and (i := content_inputs(s)) is not None and so_far <= i.kinds
                       for s in catalogue):
                raise _refused_part(catalogue, wanted, part, 1, None)
        raise OpenAIError(400, f"no pipeline takes only {' and '.join(sorted(kinds))} parts and outputs "
                          f"{sorted(wanted)}: each needs other inputs too; available: {catalogue.names()}",
                          param="messages", code="unsupported_content")
    raise OpenAIError(400, f"no pipeline takes a text prompt and outputs {sorted(wanted)}; available: "
                      f"{catalogue.names()}", param=param, code="unsupported_modality")


def audio_source(spec: PipelineSpec) -> tuple[str, str] | None:
    """(stage, port) behind the pipeline's first audio output: whose audio deltas a chat stream follows."""
    for out in spec.outputs:
        sources = getattr(out, "sources", (out.source,))
        if len(sources) == 1 and spec.stage(out.source.source).outputs.get(out.source.port) == "audio":
            return out.source.source, out.source.port
    return None


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
    return set(stage.params_model.model_fields)


Target = tuple[EngineKind, str]
"""A stage parameter an OpenAI field sets: on the stages of that engine kind that take it."""
CHAT_FIELDS: dict[str, tuple[Target, ...]] = {
    "max_completion_tokens": (("ar", "max_tokens"),), "max_tokens": (("ar", "max_tokens"),),
    "temperature": (("ar", "temperature"),), "top_p": (("ar", "top_p"),), "seed": (("ar", "seed"), ("dit", "seed")),
    "num_inference_steps": (("dit", "num_inference_steps"),), "guidance_scale": (("dit", "guidance_scale"),),
    "negative_prompt": (("dit", "negative_prompt"),), "width": (("dit", "width"),), "height": (("dit", "height"),),
}
IMAGE_FIELDS: dict[str, tuple[Target, ...]] = {
    "seed": (("dit", "seed"),), "num_inference_steps": (("dit", "num_inference_steps"),),
    "guidance_scale": (("dit", "guidance_scale"),), "negative_prompt": (("dit", "negative_prompt"),),
}
SPEECH_FIELDS: dict[str, tuple[Target, ...]] = {**IMAGE_FIELDS, "seed": (("ar", "seed"), ("dit", "seed"))}
SIZE_TARGETS: tuple[Target, Target] = (("dit", "width"), ("dit", "height"))
"""``size`` (chat, images): its width and its height."""


SPEECH_CODES_OWN = frozenset({"max_tokens", "temperature", "top_p"})
"""A talker's sampling parameters that OpenAI's fields leave alone: max_tokens, temperature and top_p are the
text reply's; a talker given a chat's max_tokens=8 would speak 8 codes (0.16 s). ``seed`` reaches it."""


def _takes(stage: StageSpec, target: Target) -> bool:
    if stage.task_name == "talk" and target[1] in SPEECH_CODES_OWN:
        return False
    return stage.engine == target[0] and target[1] in _param_fields(stage)


def build_params(spec: PipelineSpec, fields: dict[str, tuple[Target, ...]], given: dict[str, JsonScalar],
                 explicit: StageOverrides | None,
                 size: tuple[int | None, int | None] = (None, None)) -> tuple[StageOverrides, Origin]:
    """Per-stage params from the OpenAI fields ``given`` (``fields`` says which stage parameters each
    sets; ``size``: the width and height of ``size``), each only where a stage takes it. A field given
    but taken by no stage is an error naming it. ``explicit`` (the body's ``params``) is applied last."""
    sources: list[tuple[str, tuple[Target, ...], tuple[JsonScalar, ...]]] = [
        (name, targets, (given.get(name),) * len(targets)) for name, targets in fields.items()]
    sources.append(("size", SIZE_TARGETS, size))
    params: StageOverrides = {}
    origin: Origin = {}
    used: set[str] = set()
    for stage in spec.stages:
        for name, targets, values in sources:
            for target, value in zip(targets, values, strict=True):
                if value is not None and _takes(stage, target):
                    params.setdefault(stage.id, {})[target[1]] = value
                    origin[(stage.id, target[1])] = name
                    used.add(name)
    unused = sorted(name for name, _targets, values in sources if any(v is not None for v in values)
                    and name not in used)
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
        raise OpenAIError(400, f"size must be 'WIDTHxHEIGHT' (e.g. '64x64', no leading zeros) or 'auto', got "
                          f"{size!r}", param=param)
    return int(match[1]), int(match[2])



def invalid_request(exc: InvalidRequest, plan: Plan) -> OpenAIError:
    """The submitter's refusal as a 400 naming the OpenAI field its value came from: the prompt's field,
    the content part (or file) a file input came from, the field that set a stage parameter."""
    error = exc.errors[0]
    loc = tuple(str(p) for p in error.loc)
    if loc[:1] == ("input",):
        param = plan.input_origin.get(loc[1], plan.prompt_param) if len(loc) > 1 else plan.prompt_param
    elif loc[:1] == ("params",) and len(loc) >= 3:
        param = plan.origin.get((loc[1], loc[2]), ".".join(loc))
    else:
        param = ".".join(loc)
    messages = "; ".join(f"{'.'.join(map(str, e.loc))}: {e.message}" for e in exc.errors)
    return OpenAIError(400, f"{param}: {error.message} ({messages})", param=param, code=error.type)


# --- plans: what a request runs ---
@dataclass(frozen=True)
class Plan:
    """The job(s) an OpenAI request runs: one per entry of ``params`` (images: ``n``), each with ``input``."""

    spec: PipelineSpec
    input: JsonObject
    params: list[StageOverrides]
    origin: Origin = field(default_factory=dict)
    prompt_param: str = "prompt"
    """The OpenAI field the prompt came from, named when the pipeline refuses the input."""
    wanted: list[str] = field(default_factory=lambda: ["text"])
    """Chat: the modalities asked for, one choice each, in order."""
    input_origin: dict[str, str] = field(default_factory=dict)
    """Job input -> the request field it came from (a chat's media part, a transcription's file)."""
    upload: str | None = None
    """The job input the request's uploaded file goes to (its bytes are the route's: not in ``input``)."""
    audio_format: AudioFormat = "wav"
    """The format the speech is answered in (omni_jobs.audio_formats; a streamed chat: pcm)."""
    sse: bool = False
    """Speech as SSE events (``stream_format: "sse"``) rather than the file as the body."""


def _values(body: BaseModel, fields: dict[str, tuple[Target, ...]]) -> dict[str, JsonScalar]:
    """The body's values of ``fields`` (each a scalar field of the model, validated)."""
    values: dict[str, JsonScalar] = {name: getattr(body, name) for name in fields}  # getattr is untyped
    return values


def _prompt_input(spec: PipelineSpec, prompt: str) -> JsonObject:
    name = text_input(spec)
    assert name is not None  # choose_pipeline only picks pipelines that take a text prompt
    return {name: prompt}


def voice_input(spec: PipelineSpec) -> InputField | None:
    """The pipeline's voice input (a text input named ``voice``), which OpenAI's voice sets."""
    field_ = spec.inputs.get(VOICE_INPUT)
    return field_ if field_ is not None and field_.type == "text" else None


def voice_schema(spec: PipelineSpec) -> JsonObject:
    """A request's voice for ``spec``: one of its voices (or ``{'id': voice}``); anything for a pipeline without."""
    field_ = voice_input(spec)
    if field_ is None or field_.choices is None:
        return {**VOICE_SCHEMA, "description": f"Pipeline '{spec.name}' has no voice choices: any voice is taken"
                + (" as its voice input." if field_ is not None else " and not used.")}
    names: JsonObject = {"enum": [*field_.choices]}
    return {"anyOf": [names, {"type": "object", "properties": {"id": names}, "required": ["id"]}, {"type": "null"}],
            "description": f"One of pipeline '{spec.name}''s voices (default {field_.default})."}


def pick_voice(spec: PipelineSpec, voice: JsonValue, *, param: str) -> JsonObject:
    """The job input that ``voice`` sets: the pipeline's voice input, one of its choices (400 naming ``param``
    and the voices otherwise); nothing for a pipeline without a voice input, or when no voice is given.

    OpenAI's own voices (alloy, nova...) are refused, not mapped: no voice of this model sounds like them, and a
    client that asked for one should hear the list and choose, not get another voice unasked."""
    field_ = voice_input(spec)
    if field_ is None or voice is None:
        return {}
    name = voice.get("id") if isinstance(voice, dict) else voice
    if not isinstance(name, str) or (field_.choices is not None and name not in field_.choices):
        choices = ", ".join(field_.choices or ())
        raise OpenAIError(400, f"{param} must be one of pipeline '{spec.name}''s voices: {choices} (or {{'id': "
                          f"voice}}); got {voice!r} (OpenAI's voice names are not this model's)", param=param,
                          code="invalid_voice")
    return {VOICE_INPUT: name}


def chat_audio(body: ChatCompletionRequest, wanted: list[str]) -> tuple[AudioFormat, JsonValue]:
    """The speech's format and voice from a chat's ``audio`` ({voice, format}); pcm16 when speech is streamed
    (OpenAI's rule)."""
    audio = body.audio or {}
    given = audio.get("format")
    if given is not None and given not in CHAT_AUDIO_FORMATS:
        raise OpenAIError(400, f"audio.format must be one of {', '.join(CHAT_AUDIO_FORMATS)}; got {given!r}",
                          param="audio.format")
    if body.stream and "audio" in wanted and given not in (None, STREAMED_AUDIO_FORMAT):
        raise OpenAIError(400, f"audio.format is {given!r}: streamed audio is {STREAMED_AUDIO_FORMAT} (24 kHz 16-bit "
                          "mono, as OpenAI streams it); ask for it, or stream=false for another format",
                          param="audio.format")
    fmt = "pcm" if given == STREAMED_AUDIO_FORMAT or (given is None and body.stream) else str(given or "wav")
    return check_format(fmt, field="audio.format"), audio.get("voice")


def plan_chat(catalogue: PipelineCatalogue, body: ChatCompletionRequest, *,
              aliases: Collection[str] = OPENAI_MODEL_NAMES) -> Plan:
    if body.n not in (None, 1):
        raise OpenAIError(400, "n must be 1 (send several requests; each is a job)", param="n")
    wanted = list(dict.fromkeys(body.modalities or ["text"]))
    audio_format, voice = chat_audio(body, wanted)
    if body.stream and not set(wanted) <= {"text", "audio"}:
        raise OpenAIError(400, "stream=true streams text and audio: ask modalities ['text'] or ['text', 'audio'] "
                          "(images come whole; follow GET /v1/jobs/{id}/events for a job's previews)", param="stream")
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    content = read_content(body.messages)
    spec = choose_pipeline(catalogue, body.model, set(wanted), param="modalities", content=content, aliases=aliases)
    if body.stream and text_source(spec) is None and "audio" not in wanted:  # speech streams without a transcript
        raise OpenAIError(400, f"pipeline '{spec.name}' has no text output to stream", param="stream",
                          code="unsupported_modality")
    job_input, input_origin = chat_input(catalogue, spec, set(wanted), content)
    if body.max_completion_tokens is not None and body.max_tokens is not None:
        raise OpenAIError(400, "give max_completion_tokens or max_tokens, not both", param="max_tokens")
    size = parse_size(body.size)
    if size != (None, None) and (body.width, body.height) != (None, None):
        raise OpenAIError(400, "give size or width and height, not both", param="size")
    params, origin = build_params(spec, CHAT_FIELDS, _values(body, CHAT_FIELDS), body.params, size)
    job_input = {**job_input, **pick_voice(spec, voice, param="audio.voice")}  # the talker's, even for text alone
    if voice_input(spec) is not None:
        input_origin = {**input_origin, VOICE_INPUT: "audio.voice"}
    return Plan(spec, job_input, [params], origin, prompt_param="messages", wanted=wanted, input_origin=input_origin,
                audio_format=audio_format)


def chat_input(catalogue: PipelineCatalogue, spec: PipelineSpec, wanted: set[str],
               content: ChatContent) -> tuple[JsonObject, dict[str, str]]:
    """The job input of a chat on ``spec`` and, per file input, the part it came from; 400 naming the first
    part it cannot take (with the models that take it), or saying what the messages lack."""
    inputs = content_inputs(spec)
    assert inputs is not None  # choose_pipeline picks only pipelines that a chat fills
    misfit = first_misfit(inputs, content.media)
    if misfit is not None:
        raise _refused_part(catalogue, wanted, *misfit, spec)
    for kind, n in missing_kinds(inputs, content.media).items():
        parts = " or ".join(KIND_PARTS[kind])
        what = f"{n} {kind} parts" if n > 1 else f"{a_kind(kind)} part"
        raise OpenAIError(400, f"pipeline '{spec.name}' needs {what} ({parts}) in a user message", param="messages",
                          code="missing_content")
    if content.prompt is None and inputs.text_required:
        raise OpenAIError(400, f"the messages hold no text, and pipeline '{spec.name}' needs a prompt "
                          f"(its input '{inputs.text}')", param="messages", code="missing_content")
    return media_input(inputs, content)


def plan_images(catalogue: PipelineCatalogue, body: ImageGenerationRequest, *, max_outputs: int,
                aliases: Collection[str] = OPENAI_MODEL_NAMES) -> Plan:
    """One job per image: ``n`` images, not ``n`` copies (consecutive seeds from the given or default one)."""
    if body.stream:
        raise OpenAIError(400, "stream=true is not supported", param="stream")
    if body.output_format not in (None, "png"):
        raise OpenAIError(400, "output_format must be 'png'", param="output_format")
    if body.n > max_outputs:
        raise OpenAIError(400, f"n is {body.n}; this server makes at most {max_outputs} "
                          "images per call (OMNI_MAX_OUTPUTS)", param="n")
    spec = choose_pipeline(catalogue, body.model, {"image"}, param="model", aliases=aliases)
    params, origin = build_params(spec, IMAGE_FIELDS, _values(body, IMAGE_FIELDS), body.params, parse_size(body.size))
    per_job: list[StageOverrides] = []
    for i in range(body.n):
        job_params = {k: dict(v) for k, v in params.items()}
        if body.n > 1:
            for stage in spec.stages:
                base = job_params.get(stage.id, {}).get("seed", stage.defaults.get("seed", 0))
                if _takes(stage, ("dit", "seed")) and isinstance(base, int) and not isinstance(base, bool):
                    job_params.setdefault(stage.id, {})["seed"] = (base + i) % (SEED_MAX + 1)  # wraps, as seeds may
        per_job.append(job_params)
    return Plan(spec, _prompt_input(spec, body.prompt), per_job, origin, prompt_param="prompt")


def plan_speech(catalogue: PipelineCatalogue, body: SpeechRequest, *,
                aliases: Collection[str] = OPENAI_MODEL_NAMES) -> Plan:
    try:
        audio_format = check_format(body.response_format or "mp3", field="response_format")  # mp3: OpenAI's default
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="response_format") from None
    if body.stream_format not in (None, "audio", "sse"):
        raise OpenAIError(400, f"stream_format must be 'audio' or 'sse'; got {body.stream_format!r}",
                          param="stream_format")
    if body.speed not in (None, 1.0):
        raise OpenAIError(400, "speed must be 1.0", param="speed")
    spec = choose_pipeline(catalogue, body.model, {"audio"}, param="model", aliases=aliases)
    params, origin = build_params(spec, SPEECH_FIELDS, _values(body, SPEECH_FIELDS), body.params)
    job_input = {**_prompt_input(spec, body.input), **pick_voice(spec, body.voice, param="voice")}
    return Plan(spec, job_input, [params], origin, prompt_param="input", audio_format=audio_format,
                input_origin={VOICE_INPUT: "voice"} if voice_input(spec) is not None else {},
                sse=body.stream_format == "sse")


# --- the request bodies as the spec says them (api.main puts them in the OpenAPI spec) ---
@dataclass(frozen=True)
class Endpoint:
    """What a route maps, for its schema: its fields, whether it takes ``size``, the modality it
    answers with (None: chat's ``modalities``), and the field its prompt comes from."""

    fields: dict[str, tuple[Target, ...]]
    size: bool
    modality: str | None
    prompt: str
    voice: str | None = None
    """Where the request's voice is (``voice``, ``audio.voice``): its schema is the pipeline's voices."""


ENDPOINTS = {"ChatCompletionRequest": Endpoint(CHAT_FIELDS, True, None, "messages", "audio.voice"),
             "ImageGenerationRequest": Endpoint(IMAGE_FIELDS, True, "image", "prompt"),
             "SpeechRequest": Endpoint(SPEECH_FIELDS, False, "audio", "input", "voice")}
"""The component name of each route's body (FastAPI's, from the model) and what it maps."""
_MODALITIES = ("text", "image", "audio")
_NUMBER = "[1-9][0-9]{0,8}"


def _number(value: JsonValue, what: str) -> int | float:
    """A schema's number (a bound, a step), narrowed: TypeError if it is not one."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{what} is not a number: {value!r}")
    return value


def _properties(schema: JsonObject) -> JsonObject:
    """An object schema's ``properties``."""
    return json_object(schema["properties"], "properties")


def _with_required(schema: JsonObject, name: str) -> None:
    """Add ``name`` to ``schema``'s required fields (kept sorted)."""
    required = schema.get("required", [])
    names = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
    if names != required:
        raise TypeError(f"required is not a list of names: {required!r}")
    schema["required"] = [*sorted({*names, name})]


def _allowed_ints(prop: JsonObject) -> set[int] | None:
    """The integers a parameter's schema allows (None: unbounded)."""
    branches = prop.get("anyOf", [prop])
    if not isinstance(branches, list):
        raise TypeError(f"anyOf is not a list: {branches!r}")
    branch = next((b for b in map(json_object, branches) if b.get("type") == "integer"), None)
    if branch is None or "minimum" not in branch or "maximum" not in branch:
        return None
    step = int(_number(branch.get("multipleOf", 1), "multipleOf"))
    low, high = int(_number(branch["minimum"], "minimum")), int(_number(branch["maximum"], "maximum"))
    return {v for v in range(low, high + 1) if v % step == 0 and v > 0}


def _size_schema(stages: list[JsonObject]) -> JsonObject:
    """``size`` for these DiT stages' params schemas: 'auto', or the widths and heights they all take."""
    parts: list[str] = []
    for key in ("width", "height"):
        sets = [_allowed_ints(json_object(_properties(stage)[key], key)) for stage in stages
                if key in _properties(stage)]
        if not sets:
            return {"anyOf": [{"const": "auto"}, {"type": "null"}], "description": "Only 'auto': no stage takes a size."}
        bounded = [found for found in sets if found is not None]
        allowed = set.intersection(*bounded) if bounded else None
        parts.append(_NUMBER if allowed is None else "(?:" + "|".join(str(v) for v in sorted(allowed)) + ")")
    return {"anyOf": [{"type": "string", "pattern": f"^(?:auto|{parts[0]}[xX]{parts[1]})$"}, {"type": "null"}],
            "description": "'WIDTHxHEIGHT' (each a value every image stage takes) or 'auto' (the pipeline's default)."}


def _field_schema(name: str, pieces: list[JsonObject], spec: PipelineSpec) -> JsonObject:
    """An OpenAI field: what every stage it sets takes, or null when no stage takes it."""
    if not pieces:
        return {"type": "null", "description": f"Not taken by pipeline '{spec.name}' (400 if given)."}
    clean: list[JsonObject] = [{k: v for k, v in piece.items() if k not in ("default", "title")} for piece in pieces]
    taken: JsonObject = clean[0] if len(clean) == 1 else {"allOf": [*clean]}
    return {"anyOf": [taken, {"type": "null"}], "description": pieces[0].get("description", name)}


def _route(base: JsonObject, spec: PipelineSpec, endpoint: Endpoint, limits: Limits,
           model: JsonObject, modalities: JsonObject | None, kinds: frozenset[str] | None = None) -> JsonObject:
    """The body when ``spec`` runs: each field as that pipeline's stages take it, the prompt as its
    text input takes it, a chat's media parts as its file inputs take them (``kinds``: exactly these
    kinds, one part of each at least; None: those it takes), and ``params`` for what no field sets."""
    schemas = {stage.id: stage_params_schema(stage, limits) for stage in spec.stages}
    base_properties = _properties(base)
    properties: JsonObject = {**base_properties, "model": model}
    if modalities is not None:
        properties["modalities"] = modalities
    if endpoint.voice == "voice":
        properties["voice"] = voice_schema(spec)
    elif endpoint.voice == "audio.voice":
        audio = json_object(base_properties["audio"], "audio")
        properties["audio"] = {**audio, "anyOf": [
            {"type": "object", "properties": {"format": {"enum": [*CHAT_AUDIO_FORMATS, None]}, "voice": voice_schema(spec)}},
            {"type": "null"}]}
    set_by_fields: set[tuple[str, str]] = set()
    for name, targets in endpoint.fields.items():
        pieces = [json_object(_properties(schemas[stage.id])[target[1]], target[1]) for stage in spec.stages
                  for target in targets if _takes(stage, target)]
        set_by_fields |= {(stage.id, t[1]) for stage in spec.stages for t in targets if _takes(stage, t)}
        properties[name] = _field_schema(name, pieces, spec)
    if endpoint.size:
        properties["size"] = _size_schema([schemas[s.id] for s in spec.stages if s.engine == "dit"])
        set_by_fields |= {(s.id, t[1]) for s in spec.stages for t in SIZE_TARGETS if _takes(s, t)}
    overrides = params_schema(spec, limits)
    for stage_id, value in _properties(overrides).items():
        stage_schema = json_object(value, stage_id)
        stage_schema["properties"] = {k: v for k, v in _properties(stage_schema).items()
                                      if (stage_id, k) not in set_by_fields}
    overrides["description"] = ("Per-stage overrides, as in POST /v1/jobs (applied last), of what no field of this "
                                "request sets (a field's parameter is set with that field).")
    properties["params"] = overrides if overrides.get("required") else {"anyOf": [overrides, {"type": "null"}]}
    if endpoint.prompt == "messages":  # each text: the whole prompt when it is the only one; media as it fills
        inputs = content_inputs(spec)
        assert inputs is not None  # choose_pipeline and the named routes only take pipelines a chat fills
        text = {**input_field_schema(spec.inputs[inputs.text], max_text_chars=limits.max_prompt_chars),
                "pattern": NOT_BLANK}  # read_content refuses blank text, whether the input is required or not
        properties["messages"] = messages_schema(json_object(base_properties["messages"], "messages"), text, inputs,
                                                 inputs.kinds if kinds is None else kinds,
                                                 inputs.required if kinds is None else
                                                 {k: max(1, inputs.required.get(k, 0)) for k in kinds})
    else:
        prompt_input = text_input(spec)
        assert prompt_input is not None  # choose_pipeline and the named routes only take pipelines with a text prompt
        prompt = input_field_schema(spec.inputs[prompt_input], max_text_chars=limits.max_prompt_chars)
        field = json_object(base_properties[endpoint.prompt], endpoint.prompt)
        longest = [int(_number(n, "maxLength")) for n in (field.get("maxLength"), prompt.get("maxLength"))
                   if n is not None]
        properties[endpoint.prompt] = {**field, **prompt, **({"maxLength": min(longest)} if longest else {})}
    route: JsonObject = {k: v for k, v in base.items() if k not in ("properties", "title", "description")}
    route.update(title=f"{spec.name}", properties=properties)
    if overrides.get("required"):  # params must lower a default above this server's cap
        _with_required(route, "params")
    if endpoint.fields is CHAT_FIELDS:  # one of two ways to say the same thing (400 naming it otherwise)
        route["allOf"] = [
            {"anyOf": [{"properties": {"max_completion_tokens": {"type": "null"}}},
                       {"properties": {"max_tokens": {"type": "null"}}}]},
            {"anyOf": [{"properties": {"size": {"anyOf": [{"const": "auto"}, {"type": "null"}]}}},
                       {"properties": {"width": {"type": "null"}, "height": {"type": "null"}}}]},
        ]
    return route


def _modalities_within(offered: set[str]) -> JsonObject:
    """Chat's ``modalities`` when ``model`` names a pipeline: some of those it outputs."""
    within: JsonObject = {"type": "array", "items": {"enum": [*sorted(offered)]}}
    return {"anyOf": [within, {"type": "null"}]} if "text" in offered else {**within, "minItems": 1}


def _modalities_exactly(wanted: set[str]) -> JsonObject:
    """Chat's ``modalities`` when they are these (in any order, repeated or not; ['text'] by default)."""
    if wanted == {"text"}:
        return {"anyOf": [{"type": "array", "items": {"const": "text"}}, {"type": "null"}]}
    return {"type": "array", "items": {"enum": [*sorted(wanted)]},
            "allOf": [{"contains": {"const": m}} for m in sorted(wanted)]}


def alias_schema(catalogue: PipelineCatalogue, aliases: Collection[str], *, nullable: bool) -> JsonObject | None:
    """``model`` when the pipeline is chosen by what is asked: one of OpenAI's names that is no pipeline (or
    none, where ``nullable``); None when there is no such value (any other name is 404)."""
    names = sorted(set(aliases) - set(catalogue.names()))
    description = ("One of OpenAI's model names (OMNI_OPENAI_MODEL_ALIASES): the pipeline is chosen by the "
                   "modalities asked (GET /v1/models); any other name is 404 model_not_found.")
    branches: list[JsonValue] = [{"type": "string", "enum": [*names]}] if names else []
    if nullable:
        branches.append({"type": "null"})
    if not branches:
        return None
    return {**json_object(branches[0]), "description": description} if len(branches) == 1 else \
        {"anyOf": branches, "description": description}


def request_schema(name: str, base: JsonObject, catalogue: PipelineCatalogue, limits: Limits,
                   aliases: Collection[str] = OPENAI_MODEL_NAMES) -> JsonObject:
    """The body of an OpenAI route as the spec says it: ``base`` (the model's schema) once per pipeline
    the request can run, with what that pipeline takes. ``model`` naming a pipeline picks it (if it
    gives the modality and takes a text prompt); no model or one of OpenAI's names (``aliases``) picks one
    by the modalities asked and, in a chat, the kinds of media its messages hold (choose_pipeline), so
    there is a route per set of modalities (and media) too; any other name is in no route (404). A
    pipeline that cannot serve the request is in no route (400)."""
    endpoint = ENDPOINTS[name]
    required = base.get("required", [])
    other = alias_schema(catalogue, aliases, nullable=not isinstance(required, list) or "model" not in required)
    chat = endpoint.prompt == "messages"
    routes: list[JsonValue] = []
    for spec in catalogue:
        offered = output_modalities(spec) & set(_MODALITIES)
        fillable = content_inputs(spec) is not None if chat else text_input(spec) is not None
        if not fillable or not offered or (endpoint.modality and endpoint.modality not in offered):
            continue
        modalities = None if endpoint.modality else _modalities_within(offered)
        route = _route(base, spec, endpoint, limits, {"const": spec.name}, modalities)
        _with_required(route, "model")  # a body without a model is not this route (the routes of other names take it)
        if modalities is not None and "text" not in offered:  # the default, ['text'], is not one
            _with_required(route, "modalities")
        routes.append(route)
    choices = [{endpoint.modality}] if endpoint.modality else [
        set(c) for n in range(1, len(_MODALITIES) + 1) for c in itertools.combinations(_MODALITIES, n)]
    kind_sets = [frozenset(c) for n in range(len(FILE_KINDS) + 1) for c in itertools.combinations(FILE_KINDS, n)]
    for wanted in choices:
        for kinds in kind_sets if chat else [frozenset()]:
            candidates = _chat_candidates(catalogue, wanted, kinds)
            if not candidates or other is None:
                continue  # no pipeline gives them: 400; no name to ask for them by: 404
            spec = _best(candidates, wanted, kinds)
            route = _route(base, spec, endpoint, limits, other,
                           None if endpoint.modality else _modalities_exactly(wanted), kinds if chat else None)
            media = f" with {'+'.join(k for k in FILE_KINDS if k in kinds)}" if kinds else ""
            route["title"] = f"an OpenAI model name, {'+'.join(sorted(wanted))}{media}: {spec.name}"
            if endpoint.modality is None and wanted != {"text"}:
                _with_required(route, "modalities")
            routes.append(route)
    description = base.get("description", "")
    if not isinstance(description, str):
        raise TypeError(f"description is not text: {description!r}")
    schema: JsonObject = {"title": base.get("title", name), "description": description + " One schema per "
                          "pipeline the request can run (by `model`, else by the modalities asked), with what it takes; a "
                          "`model` that is neither a pipeline nor one of OpenAI's names is 404 model_not_found."}
    if routes:  # disjoint (by model; for OpenAI's names, by the modalities and media asked): exactly one holds
        schema["oneOf"] = routes  # (and schemathesis models a oneOf of many routes, where an anyOf outgrows it)
    else:
        schema["not"] = {}
    return schema


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


def reported_text_meta(document: JsonValue) -> tuple[str | None, dict[str, int] | None]:
    """(finish_reason, usage) as the AR engine reported them in its text document (None, None when it did not:
    a stage output kept from before it did, in the stage-output cache); CodecError if it is no JSON object."""
    if not isinstance(document, dict):
        raise CodecError(f"a text payload is a JSON object, got {type(document).__name__}")
    usage: dict[str, int] | None = None
    reported = document.get("usage")
    if isinstance(reported, dict):
        prompt, completion = reported.get("prompt_tokens"), reported.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    finish = document.get("finish_reason")
    return (finish if isinstance(finish, str) else None), usage


def finish_by_length(tokens: int, max_tokens: object) -> str:
    """The finish_reason of a text whose engine did not report one: 'length' when it made max_tokens tokens."""
    return "length" if isinstance(max_tokens, int | float) and tokens >= int(max_tokens) else "stop"


def text_meta(spec: PipelineSpec, job: Job,
              read: Callable[[ArtifactRef], bytes]) -> tuple[str, dict[str, int] | None]:
    """(finish_reason, usage) of the chat's text answer, as the AR engine reported them beside its text (``read``:
    an artifact's bytes; blocking). A stage output written before the engine reported them (kept in the
    stage-output cache) has neither: then 'length' when the stage made max_tokens tokens, else 'stop', and no
    usage."""
    from omni_jobs.artifacts import codecs
    from omni_jobs.payloads import decode_payload

    source = text_source(spec)
    if source is None:
        return "stop", None
    stage_id, port = source
    ref = job.stage_record(stage_id).outputs.get(port)
    if ref is None:
        return "stop", None
    finish, usage = reported_text_meta(codecs.decode_json(read(ref)))
    if finish is not None:
        return finish, usage
    tokens_ref = job.stage_record(stage_id).outputs.get("token_ids")
    max_tokens = job.params.get(stage_id, {}).get("max_tokens")
    if tokens_ref is None or max_tokens is None:
        return "stop", usage
    return finish_by_length(len(decode_payload("token_ids", read(tokens_ref))), max_tokens), usage


def chat_completion(plan: Plan, job: Job, *, finish: str, usage: dict[str, int] | None,
                    data: Mapping[str, bytes], output_ttl_s: int) -> JsonObject:
    """The chat.completion body: one choice per asked modality. ``data``: output name -> its bytes."""
    text = text_of(job)
    choices: list[JsonValue] = []
    for index, modality in enumerate(plan.wanted):
        message: JsonObject = {"role": "assistant", "content": None}
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
            "model": plan.spec.name, "choices": choices, "usage": {**usage} if usage is not None else None,
            "system_fingerprint": None}


def image_items(job: Job, response_format: str | None, *, data: Mapping[str, bytes] | None = None,
                urls: Mapping[str, str] | None = None) -> list[JsonObject]:
    """The ``data`` entries of one job's images: ``b64_json`` from ``data`` or ``url`` from ``urls``."""
    revised = text_of(job)
    items: list[JsonObject] = []
    for out in outputs_of(job, "image"):
        item: JsonObject = {}
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


def images_response(jobs: list[Job], items: list[JsonObject]) -> JsonObject:
    first = outputs_of(jobs[0], "image")
    size = f"{first[0].width}x{first[0].height}" if first and first[0].width else None
    return {"created": int(jobs[0].created_at), "data": [*items], "output_format": "png", "size": size}


def model_card(spec: PipelineSpec, created: int) -> JsonObject:
    """A pipeline as an OpenAI model (GET /v1/models)."""
    return {"id": spec.name, "object": "model", "created": created, "owned_by": "omni-jobs",
            "description": spec.description.strip(), "output_modalities": [*sorted(output_modalities(spec))],
            "stages": [*(s.id for s in spec.stages)]}


# --- streamed speech (chat with stream=true and the audio modality) ---
STREAM_PIECE_BYTES = PCM_RATE * 2 // 2
"""Audio sent from the final clip (what no delta carried) goes out in pieces of 0.5 s of 24 kHz pcm16."""


def streamed_pcm(chunk: AudioChunk) -> bytes:
    """An audio delta's samples as OpenAI streams audio: 24 kHz pcm16 (resampled when the stage's rate differs)."""
    if chunk.sample_rate == PCM_RATE:
        return chunk.pcm
    samples = np.frombuffer(chunk.pcm, "<i2").astype(np.float32)[np.newaxis, :] / 32767.0
    return pcm16(samples, chunk.sample_rate)


def unsent_pcm(clip_pcm: bytes, handed_out: int, sample_rate: int | None) -> list[bytes]:
    """The part of the final clip (24 kHz pcm16) beyond the ``handed_out`` samples the deltas carried (at their
    ``sample_rate``), in pieces: all of it when no delta came (a stage that does not stream)."""
    offset = 2 * (handed_out * PCM_RATE // sample_rate if sample_rate else 0)
    rest = clip_pcm[offset:]
    return [rest[i:i + STREAM_PIECE_BYTES] for i in range(0, len(rest), STREAM_PIECE_BYTES)]


def audio_delta_message(audio_id: str, *, transcript: str | None = None, data: bytes | None = None,
                        expires_at: int | None = None) -> JsonObject:
    """A chunk's ``delta`` for streamed speech, as OpenAI's clients read it: ``delta.audio`` with the id and one
    of the transcript's new text, base64 pcm16, or (last) ``expires_at``."""
    audio: JsonObject = {"id": audio_id}
    if transcript is not None:
        audio["transcript"] = transcript
    if data is not None:
        audio["data"] = base64.b64encode(data).decode("ascii")
    if expires_at is not None:
        audio["expires_at"] = expires_at
    return {"audio": audio}


def speech_event(kind: Literal["delta", "done"], *, audio: bytes = b"", usage: dict[str, int] | None = None
                 ) -> JsonObject:
    """One SSE event of ``/v1/audio/speech`` with ``stream_format: "sse"``, as OpenAI sends them:
    ``speech.audio.delta`` {audio: base64} or ``speech.audio.done`` {usage}."""
    if kind == "delta":
        return {"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode("ascii")}
    tokens = usage or {}
    return {"type": "speech.audio.done", "usage": {"input_tokens": tokens.get("prompt_tokens", 0),
                                                   "output_tokens": tokens.get("completion_tokens", 0),
                                                   "total_tokens": tokens.get("total_tokens", 0)}}
