"""OpenAI's audio transcriptions and translations as jobs, as pure functions: the form read, the plan,
and the answer in each response format.

``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` take a multipart form (``file``,
``model``, ``language``, ``prompt``, ``temperature``, ``response_format``,
``timestamp_granularities[]``) and run a pipeline whose first stage is an AR ``transcribe`` task
(Whisper on vLLM). ``model`` names one; one of OpenAI's names (``whisper-1``: OMNI_OPENAI_MODEL_ALIASES)
runs ``speech-to-text``, or the first such pipeline when there is none by that name; any other name is
OpenAI's 404 ``model_not_found``. The file goes to the stage's audio input, the
prompt to its prompt input (the text that came before the clip), ``language`` and ``temperature`` to
the stage's parameters, and ``task`` is ``transcribe`` or ``translate`` by the route.

The stage's text output is a JSON document ``{text, language, duration, task, segments: [{id, start,
end, text}], usage}``; the answer is made from it in the format asked: ``json`` ``{"text", "usage"}``,
``verbose_json`` with OpenAI's segment fields, ``text`` (the text alone), ``srt`` and ``vtt`` (one
cue per segment). verbose_json's ``language`` is the text's, as OpenAI's: the spoken one (ISO 639-1,
'und' when neither given nor detected), English for a translation. What the engine does not measure is answered with a neutral value:
``avg_logprob`` and ``no_speech_prob`` 0, ``tokens`` empty (unless the document carries them);
``seek`` is the start in Whisper's 10 ms frames and ``compression_ratio`` is Whisper's own (UTF-8
bytes over zlib-compressed bytes of the segment's text).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.accept.openai_models import by_request
from omni_jobs.accept.openai_requests import Plan, StageOverrides, transcription_stage
from omni_jobs.core.json_types import JsonObject, JsonValue
from omni_jobs.core.settings import OPENAI_MODEL_NAMES
from omni_jobs.dispatch.checks import is_builtin
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.limits import Limits
from omni_jobs.pipelines.schema import input_field_schema, json_object, stage_params_schema
from omni_jobs.pipelines.spec import INPUT_SOURCE, PipelineSpec, StageSpec

Task = Literal["transcribe", "translate"]
ResponseFormat = Literal["json", "text", "srt", "vtt", "verbose_json"]
RESPONSE_FORMATS: tuple[ResponseFormat, ...] = ("json", "text", "srt", "vtt", "verbose_json")
MEDIA_TYPES: dict[str, str] = {"json": "application/json", "verbose_json": "application/json",
                               "text": "text/plain; charset=utf-8", "srt": "text/plain; charset=utf-8",
                               "vtt": "text/vtt; charset=utf-8"}
"""The answer's Content-Type per format (OpenAI answers srt as text/plain)."""
DEFAULT_PIPELINE = "speech-to-text"
FILE_FIELD = "file"
TEXT_FIELDS = ("model", "language", "prompt", "temperature", "response_format", "timestamp_granularities[]",
               "stream")
"""The form's fields besides ``file`` (the openai client's names: a list field ends with ``[]``)."""
GRANULARITIES = ("segment",)
"""``timestamp_granularities[]`` taken: segments (the engine times no words)."""
_FALSE = ("false", "False")


# --- the form ---
@dataclass(frozen=True)
class TranscriptionForm:
    """The form's text fields, read (the file stays the route's: bytes)."""

    model: str
    language: str | None = None
    prompt: str | None = None
    temperature: float | None = None
    response_format: ResponseFormat = "json"


def read_form(fields: Sequence[tuple[str, str]]) -> TranscriptionForm:
    """The form's text fields (``(name, value)`` in order; a list field may repeat); 400 naming the field
    that is unknown, repeated, missing or wrong."""
    values: dict[str, str] = {}
    for name, value in fields:
        if name == "timestamp_granularities[]":
            if value not in GRANULARITIES:
                raise OpenAIError(400, f"timestamp_granularities[] takes {', '.join(GRANULARITIES)} (the engine times "
                                  f"segments, not words), got {value!r}", param=name)
            continue
        if name not in TEXT_FIELDS:
            raise OpenAIError(400, f"unknown form field {name!r}; the form takes {FILE_FIELD}, {', '.join(TEXT_FIELDS)}",
                              param=name)
        if name in values:
            raise OpenAIError(400, f"{name} is given twice", param=name)
        values[name] = value
    if "model" not in values:
        raise OpenAIError(400, "model is required: a speech-to-text pipeline (GET /v1/models), or one of OpenAI's "
                          f"names (whisper-1) for '{DEFAULT_PIPELINE}'", param="model")
    if values.get("stream", "false") not in _FALSE:
        raise OpenAIError(400, "stream must be false: transcriptions come whole", param="stream")
    response_format = values.get("response_format", "json")
    if response_format not in RESPONSE_FORMATS:
        raise OpenAIError(400, f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got "
                          f"{response_format!r}", param="response_format")
    temperature: float | None = None
    if "temperature" in values:
        try:
            temperature = float(values["temperature"])
        except ValueError:
            temperature = math.nan
        if not math.isfinite(temperature):
            raise OpenAIError(400, f"temperature must be a number, got {values['temperature']!r}", param="temperature")
    return TranscriptionForm(model=values["model"], language=values.get("language"), prompt=values.get("prompt"),
                             temperature=temperature,
                             response_format=next(f for f in RESPONSE_FORMATS if f == response_format))


# --- which pipeline, with what ---
@dataclass(frozen=True)
class SpeechInputs:
    """What a transcription fills of a pipeline: its speech-to-text stage, the job input the file goes
    to, and the one the prompt goes to (None: it takes none)."""

    stage: StageSpec
    audio: str
    prompt: str | None


def speech_inputs(spec: PipelineSpec) -> SpeechInputs | None:
    """None unless the first stage transcribes a job input of type audio, and the pipeline needs no
    input but that and the stage's prompt."""
    stage = transcription_stage(spec)
    if stage is None:
        return None
    audio, prompt = stage.binding("audio"), stage.binding("prompt")
    if audio is None or audio.source != INPUT_SOURCE or spec.inputs[audio.port].type != "audio":
        return None
    prompt_input = prompt.port if prompt is not None and prompt.source == INPUT_SOURCE else None
    if any(name not in (audio.port, prompt_input) and field.required and field.default is None
           for name, field in spec.inputs.items()):
        return None
    return SpeechInputs(stage, audio.port, prompt_input)


def speech_pipelines(catalogue: PipelineCatalogue) -> list[PipelineSpec]:
    return [spec for spec in catalogue if speech_inputs(spec) is not None]


def default_speech_pipeline(catalogue: PipelineCatalogue) -> PipelineSpec | None:
    """What OpenAI's model names run: ``speech-to-text``, else the first speech pipeline (built-in first)."""
    found = speech_pipelines(catalogue)
    if not found:
        return None
    return min(found, key=lambda s: (s.name != DEFAULT_PIPELINE, not is_builtin(s), s.name))


def plan_transcription(catalogue: PipelineCatalogue, form: TranscriptionForm, task: Task, *,
                       aliases: Collection[str] = OPENAI_MODEL_NAMES) -> Plan:
    """The job: the file to the speech stage's audio input (``Plan.upload``), the prompt to its prompt
    input, ``task``, ``language`` and ``temperature`` to the stage. ``model``: a pipeline, or one of
    OpenAI's names (``aliases``) for the default speech pipeline; 404 model_not_found otherwise."""
    if not by_request(form.model, catalogue.names(), aliases):
        spec = catalogue.get(form.model)
        if speech_inputs(spec) is None:
            names = [s.name for s in speech_pipelines(catalogue)]
            raise OpenAIError(400, f"pipeline '{spec.name}' is no speech-to-text pipeline (its first stage is no AR "
                              f"transcribe task fed the job's audio); these are: {', '.join(names) or 'none'}",
                              param="model", code="unsupported_pipeline")
    else:
        found = default_speech_pipeline(catalogue)
        if found is None:
            raise OpenAIError(400, f"no pipeline transcribes audio; available: {catalogue.names()}", param="model",
                              code="model_not_found")
        spec = found
    inputs = speech_inputs(spec)
    assert inputs is not None
    job_input: JsonObject = {}
    if form.prompt is not None:
        if inputs.prompt is None:
            raise OpenAIError(400, f"pipeline '{spec.name}' takes no prompt", param="prompt",
                              code="unsupported_parameter")
        job_input[inputs.prompt] = form.prompt
    stage_id = inputs.stage.id
    params: StageOverrides = {stage_id: {"task": task}}
    origin = {(stage_id, "task"): "model"}
    for name, value in (("language", form.language), ("temperature", form.temperature)):
        if value is not None:
            params[stage_id][name] = value
            origin[(stage_id, name)] = name
    return Plan(spec, job_input, [params], origin, prompt_param="prompt", input_origin={inputs.audio: FILE_FIELD},
                upload=inputs.audio)


# --- the answer ---
@dataclass(frozen=True)
class Segment:
    id: int
    start: float
    end: float
    text: str
    extra: JsonObject
    """What else the document says of it (tokens, avg_logprob... when an engine reports them)."""


@dataclass(frozen=True)
class Transcript:
    """The speech stage's text document, read."""

    text: str
    language: str | None
    duration: float
    task: str
    segments: tuple[Segment, ...]


def _number(value: JsonValue, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} is not a number: {value!r}")
    return float(value)


def read_transcript(document: JsonValue) -> Transcript:
    """The document a speech stage writes; TypeError naming what is missing or of the wrong type."""
    doc = json_object(document, "the transcription document")
    text, language, task = doc.get("text"), doc.get("language"), doc.get("task", "transcribe")
    if not isinstance(text, str) or not isinstance(task, str) or not (language is None or isinstance(language, str)):
        raise TypeError(f"a transcription document has text, task and language, got {sorted(doc)}")
    raw = doc.get("segments", [])
    if not isinstance(raw, list):
        raise TypeError("the transcription's segments are not a list")
    segments: list[Segment] = []
    for i, item in enumerate(raw):
        segment = json_object(item, f"segment {i}")
        seg_text = segment.get("text", "")
        if not isinstance(seg_text, str):
            raise TypeError(f"segment {i}'s text is not text")
        seg_id = segment.get("id", i)
        segments.append(Segment(int(_number(seg_id, f"segment {i}'s id")), _number(segment.get("start"), "start"),
                                _number(segment.get("end"), "end"), seg_text,
                                {k: v for k, v in segment.items() if k not in ("id", "start", "end", "text")}))
    return Transcript(text, language, _number(doc.get("duration"), "duration"), task, tuple(segments))


def compression_ratio(text: str) -> float:
    """Whisper's: the text's UTF-8 bytes over their zlib-compressed bytes (high: repetitive, a loop)."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data))


def timestamp(seconds: float, separator: str) -> str:
    """``HH:MM:SS,mmm`` (SRT: ``separator`` ',') or ``HH:MM:SS.mmm`` (WebVTT: '.')."""
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{ms:03d}"


def _cues(transcript: Transcript, separator: str) -> list[str]:
    """One cue per segment that holds text: its times and its text."""
    return [f"{timestamp(s.start, separator)} --> {timestamp(s.end, separator)}\n{s.text.strip()}"
            for s in transcript.segments if s.text.strip()]


def srt(transcript: Transcript) -> str:
    return "".join(f"{i}\n{cue}\n\n" for i, cue in enumerate(_cues(transcript, ","), start=1))


def vtt(transcript: Transcript) -> str:
    return "WEBVTT\n\n" + "".join(f"{cue}\n\n" for cue in _cues(transcript, "."))


def _segment(segment: Segment, temperature: float) -> JsonObject:
    """A segment in OpenAI's verbose shape (the module's docstring says what is not measured)."""
    answer: JsonObject = {"id": segment.id, "seek": round(segment.start * 100), "start": segment.start,
                          "end": segment.end, "text": segment.text, "tokens": [], "temperature": temperature,
                          "avg_logprob": 0.0, "compression_ratio": round(compression_ratio(segment.text), 6),
                          "no_speech_prob": 0.0}
    answer.update({k: v for k, v in segment.extra.items() if k in answer})
    return answer


def transcription_answer(transcript: Transcript, response_format: ResponseFormat, *,
                         temperature: float) -> tuple[JsonObject | str, str]:
    """The answer's body (a JSON object, or text) and its Content-Type. ``temperature``: the stage's."""
    usage: JsonObject = {"type": "duration", "seconds": transcript.duration}
    if response_format == "json":
        return {"text": transcript.text, "usage": usage}, MEDIA_TYPES["json"]
    if response_format == "verbose_json":
        language = "en" if transcript.task == "translate" else transcript.language or "und"  # the text's language
        return ({"task": transcript.task, "language": language, "duration": transcript.duration,
                 "text": transcript.text, "segments": [_segment(s, temperature) for s in transcript.segments],
                 "usage": usage}, MEDIA_TYPES["verbose_json"])
    if response_format == "srt":
        return srt(transcript), MEDIA_TYPES["srt"]
    if response_format == "vtt":
        return vtt(transcript), MEDIA_TYPES["vtt"]
    return transcript.text, MEDIA_TYPES["text"]


# --- the form as the spec says it ---
def _not_null(schema: JsonValue, what: str) -> JsonObject:
    """A parameter's schema without its null branch (a form field is text; leaving it out is its null)."""
    prop = json_object(schema, what)
    branches = prop.get("anyOf")
    kept = [json_object(b, what) for b in branches if b != {"type": "null"}] if isinstance(branches, list) else [prop]
    clean: JsonObject = {k: v for k, v in kept[0].items() if k not in ("default", "title")} if len(kept) == 1 else \
        {"anyOf": [*kept]}
    if "description" in prop:
        clean["description"] = prop["description"]
    return clean


def _fields(spec: PipelineSpec, inputs: SpeechInputs, limits: Limits) -> JsonObject:
    """What ``spec`` takes in the form's language, temperature and prompt (its stage's, its prompt input's)."""
    stage = json_object(stage_params_schema(inputs.stage, limits)["properties"], "properties")
    prompt: JsonValue = False
    if inputs.prompt is not None:
        prompt = input_field_schema(spec.inputs[inputs.prompt], max_text_chars=limits.max_prompt_chars)
    return {"language": _not_null(stage["language"], "language"),
            "temperature": _not_null(stage["temperature"], "temperature"), "prompt": prompt}


def _union(schemas: list[JsonValue], description: str) -> JsonValue:
    """One schema that takes what any of ``schemas`` takes (itself when they are all the same)."""
    distinct = [s for i, s in enumerate(schemas) if s not in schemas[:i] and s is not False]
    if not distinct:
        return False
    one = json_object(distinct[0]) if len(distinct) == 1 else {"anyOf": [*distinct]}
    return {**one, "description": description}


def form_body(catalogue: PipelineCatalogue, limits: Limits, aliases: Collection[str] = OPENAI_MODEL_NAMES
              ) -> JsonObject:
    """The OpenAPI requestBody of both routes: the fields, and one branch per speech pipeline (by
    ``model``) with what its stage and prompt input take, and one for OpenAI's model names (``aliases``).

    The fields say it too, as the union over the speech pipelines (exact with one, as built in):
    schemathesis generates a form from its fields and leaves its branches out."""
    speech = [(spec, inputs) for spec in catalogue if (inputs := speech_inputs(spec)) is not None]
    default = default_speech_pipeline(catalogue)
    other_names = sorted(set(aliases) - set(catalogue.names()))
    other: JsonObject = {"type": "string", "enum": [*other_names],
                         "description": f"One of OpenAI's model names (OMNI_OPENAI_MODEL_ALIASES) runs "
                         f"'{default.name if default else DEFAULT_PIPELINE}'; any other name is 404 model_not_found."}
    taken = [_fields(spec, inputs, limits) for spec, inputs in speech]
    described = {"language": "The spoken language, ISO 639-1 (e.g. 'en'); detected if absent.",
                 "temperature": "Sampling temperature; 0 is greedy.",
                 "prompt": "Text that came before the clip (names, spellings)."}
    properties: JsonObject = {
        FILE_FIELD: {"type": "string", "format": "binary",
                     "description": "The speech: any audio FFmpeg reads (WAV, FLAC, MP3, OGG, M4A, WebM...)."},
        "model": {"anyOf": [{"type": "string", "enum": [spec.name for spec, _ in speech]},
                            *([other] if other_names else [])],
                  "examples": [DEFAULT_PIPELINE, "whisper-1"],
                  "description": f"A speech-to-text pipeline (GET /v1/models), or one of OpenAI's model names "
                  f"(whisper-1) for '{DEFAULT_PIPELINE}'; any other name is 404 model_not_found."}
        if speech else False,
        **{name: _union([t[name] for t in taken], text) for name, text in described.items()},
        "response_format": {"type": "string", "enum": [*RESPONSE_FORMATS], "default": "json"},
        "timestamp_granularities[]": {"type": "array", "items": {"type": "string", "enum": [*GRANULARITIES]},
                                      "description": "Segments are timed (not words)."},
        "stream": {"type": "boolean", "enum": [False], "description": "No streaming: the transcription comes whole."},
    }
    branches: list[JsonValue] = [{"type": "object", "title": spec.name,
                                  "properties": {"model": {"type": "string", "const": spec.name}, **fields}}
                                 for (spec, _), fields in zip(speech, taken, strict=True)]
    if default is not None and other_names:
        inputs = speech_inputs(default)
        assert inputs is not None
        branches.append({"type": "object", "title": f"an OpenAI model name: {default.name}",
                         "properties": {"model": other, **_fields(default, inputs, limits)}})
    schema: JsonObject = {"type": "object", "required": [FILE_FIELD, "model"], "properties": properties,
                          "additionalProperties": False}
    if len(branches) > 1:
        schema["anyOf"] = branches
    return {"required": True, "content": {"multipart/form-data": {"schema": schema}}}
