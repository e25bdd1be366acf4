"""OpenAI-compatible requests mapped onto jobs, as pure functions (no HTTP, no I/O): the request
bodies, the choice of pipeline, the parameters each field sets, and the plan a request runs.

api/routes/openai.py translates HTTP: it parses a request into one of the models here, asks for its
:class:`Plan` (which pipeline runs, with what input and per-stage params), submits and waits for the
job(s), fetches the output bytes, and hands the finished jobs to omni_jobs.accept.openai_responses for the
answer's body. An
:class:`OpenAIError` is the error in OpenAI's shape; the route turns it into the HTTP answer.

Which pipeline runs: ``model`` when it names a pipeline; for no model or one of OpenAI's names
(``gpt-4o``, ``dall-e-3``, ``tts-1``...: OMNI_OPENAI_MODEL_ALIASES), one whose declared outputs include every asked modality and whose inputs a request
fills: a text prompt, and for chat the kinds of media its messages hold (omni_jobs.accept.openai_content),
preferring the conventional ``<input>-to-<modality>`` name (``text-to-image``; ``image-to-text`` for
a chat with images), then the fewest other outputs, answers before transcripts, the fewest media
inputs left empty, built-in before user pipelines, the fewest stages, then the name. Any other
name is OpenAI's 404 ``model_not_found`` (omni_jobs.accept.openai_models): a typo is not served by another model.

Which stage parameter each OpenAI field sets is a table (CHAT_FIELDS, IMAGE_FIELDS, SPEECH_FIELDS).
The request models carry, in their JSON schema, what the checks here accept (a pattern, the one
allowed value); omni_jobs.accept.openai_schema's request_schema adds, from the same tables and the same pipeline choice, one
schema per pipeline a request can run with what its stages take, so that the OpenAPI spec says
it. The checks answer 400 with their own message.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Annotated, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator

from omni_jobs.accept.openai_content import (
    KIND_PARTS,
    ChatContent,
    ChatMessageIn,
    ContentInputs,
    MediaPart,
    a_kind,
    content_inputs,
    first_misfit,
    media_input,
    missing_kinds,
    read_content,
)
from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.accept.openai_models import by_request
from omni_jobs.core.errors import InvalidRequest
from omni_jobs.core.json_types import JsonObject, JsonScalar, JsonValue
from omni_jobs.core.settings import OPENAI_MODEL_NAMES
from omni_jobs.dispatch.checks import is_builtin
from omni_jobs.media.audio_formats import AUDIO_FORMATS, AudioFormat, check_format
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.modalities import EngineKind
from omni_jobs.pipelines.params import SEED_MAX, whole_numbers
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
"""A chat's ``audio.format`` (OpenAI's names: ``pcm16`` is omni_jobs.media.audio_formats' ``pcm``); streamed, only
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


def pipeline_candidates(catalogue: PipelineCatalogue, wanted: set[str], kinds: frozenset[str]) -> list[PipelineSpec]:
    return [s for s in catalogue if wanted <= output_modalities(s) and fills(content_inputs(s), kinds)]


def best_candidate(candidates: list[PipelineSpec], wanted: set[str], kinds: frozenset[str]) -> PipelineSpec:
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
    its messages hold; any other name is 404 model_not_found (omni_jobs.accept.openai_models). Whether the chosen
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
    candidates = pipeline_candidates(catalogue, wanted, kinds)
    if candidates:
        return best_candidate(candidates, wanted, kinds)
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


def takes(stage: StageSpec, target: Target) -> bool:
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
                if value is not None and takes(stage, target):
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
    """The format the speech is answered in (omni_jobs.media.audio_formats; a streamed chat: pcm)."""
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
                if takes(stage, ("dit", "seed")) and isinstance(base, int) and not isinstance(base, bool):
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
