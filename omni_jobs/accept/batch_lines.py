"""The lines of a batch file (OpenAI's Batch API), read and checked: pure, no I/O.

A batch file is JSONL, one request a line: ``{"custom_id", "method": "POST", "url", "body"}``. Each
line's body is checked by the route's own mapping (the request models and plans of
omni_jobs.accept.openai_requests, then the submitter's validation of the job it makes), so a line is refused
for what its route would refuse, with the same message, and the job it becomes is the job that route
would submit. A refused file names the lines at fault (1-based), as OpenAI's batch errors do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import orjson
from pydantic import BaseModel, ValidationError

from omni_jobs.accept.openai_audio import FILE_FIELD, Task, TranscriptionForm, plan_transcription, read_form
from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.accept.openai_requests import (
    ChatCompletionRequest,
    ImageGenerationRequest,
    Plan,
    SpeechRequest,
    StageOverrides,
    invalid_request,
    plan_chat,
    plan_images,
    plan_speech,
)
from omni_jobs.core.errors import InvalidRequest
from omni_jobs.core.json_types import JsonObject, JsonValue
from omni_jobs.pipelines.catalogue import PipelineCatalogue

CHAT = "/v1/chat/completions"
IMAGES = "/v1/images/generations"
SPEECH = "/v1/audio/speech"
TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
JOBS = "/v1/jobs"
ENDPOINTS = (CHAT, IMAGES, SPEECH, TRANSCRIPTIONS, TRANSLATIONS, JOBS)
"""The routes a batch line may name. A transcription's form becomes the line's JSON body: its text fields
as JSON values, and ``file`` the audio as a file input takes it in POST /v1/jobs (a data: URI, base64, or a
stored output's URL), since a JSONL line carries no multipart upload."""
SPEECH_TO_TEXT: dict[str, Task] = {TRANSCRIPTIONS: "transcribe", TRANSLATIONS: "translate"}
JOB_FIELDS = frozenset({"pipeline", "input", "params", "webhook", "webhook_events_filter", "priority"})
MAX_REPORTED_ERRORS = 20
"""A refused file's answer lists this many faulty lines at most (and how many there were)."""


@dataclass(frozen=True)
class LineError:
    """One faulty line: OpenAI's batch error object ``{code, message, param, line}``."""

    line: int
    message: str
    param: str | None = None
    code: str = "invalid_request"

    def as_json(self) -> JsonObject:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


class BatchFileInvalid(Exception):
    """A file refused with the lines at fault (the first MAX_REPORTED_ERRORS) and how many there were."""

    def __init__(self, errors: list[LineError], total: int) -> None:
        self.errors = errors
        self.total = total
        first = errors[0]
        more = f" (and {total - 1} more faulty line{'s' if total > 2 else ''})" if total > 1 else ""
        super().__init__(f"line {first.line}: {first.message}{more}")


@dataclass(frozen=True)
class RequestLine:
    """One request of a batch file: its 0-based ``index`` (the line number is ``index + 1``)."""

    index: int
    custom_id: str
    url: str
    body: JsonObject


@dataclass(frozen=True)
class LinePlan:
    """The job(s) one line runs: one per entry of ``params`` (an images line with ``n`` > 1: ``n``)."""

    pipeline: str
    input: JsonObject
    params: list[StageOverrides]
    openai: Plan | None = None
    """The OpenAI route's plan (None for /v1/jobs): what shapes the answer once the jobs ended."""
    body: JsonObject = field(default_factory=dict)
    webhook: JsonValue = None
    webhook_events_filter: JsonValue = None
    form: TranscriptionForm | None = None
    """A transcription's form (its response_format shapes the answer)."""


class Validator(Protocol):
    """What checks a job's pipeline, input and params (JobSubmitter.validate, validate_webhook)."""

    def validate(self, pipeline: str, input_: object, params: object) -> object: ...

    def validate_webhook(self, url: object, events: object) -> object: ...


class LineRefused(Exception):
    """A line's body refused by its route: the message and the field (``param``) at fault."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def _from_openai(exc: OpenAIError) -> LineRefused:
    return LineRefused(exc.message, exc.param, exc.code or "invalid_request")


def _model(model: type[BaseModel], body: JsonObject) -> BaseModel:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise LineRefused(f"body.{param}: {first['msg']}" if param else str(first["msg"]), param) from None


@dataclass
class LinePlanner:
    """Plans a line as its route would: the route's request model, its plan, then the submitter's checks."""

    catalogue: PipelineCatalogue
    validator: Validator
    aliases: Collection[str]
    max_outputs: int

    def plan(self, url: str, body: JsonObject) -> LinePlan:
        """The job(s) of one line; LineRefused naming the field its route refuses."""
        form: TranscriptionForm | None = None
        try:
            if url == JOBS:
                return self._job(body)
            if url in SPEECH_TO_TEXT:
                plan, form = self._speech_to_text(SPEECH_TO_TEXT[url], body)
            else:
                plan = self._openai(url, body)
        except OpenAIError as exc:
            raise _from_openai(exc) from None
        for params in plan.params:
            try:
                self.validator.validate(plan.spec.name, plan.input, params)
            except InvalidRequest as exc:
                raise _from_openai(invalid_request(exc, plan)) from None
        return LinePlan(plan.spec.name, plan.input, plan.params, plan, body, form=form)

    def _speech_to_text(self, task: Task, body: JsonObject) -> tuple[Plan, TranscriptionForm]:
        """The transcription route's form from a JSON body (its own checks: read_form, plan_transcription);
        the audio, ``file``, goes to the pipeline's audio input as a file input value."""
        audio = body.get(FILE_FIELD)
        if audio is None:
            raise LineRefused(f"body.{FILE_FIELD} is required: the audio as a data: URI, base64, or the URL of a "
                              "stored output", FILE_FIELD)
        fields: list[tuple[str, str]] = []
        for name, value in body.items():
            if name == FILE_FIELD:
                continue
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, bool):
                    fields.append((name, "true" if item else "false"))
                elif isinstance(item, str | int | float):
                    fields.append((name, str(item)))
                else:
                    raise LineRefused(f"body.{name}: a form field is a string, number or boolean", name)
        form = read_form(fields)
        plan = plan_transcription(self.catalogue, form, task, aliases=self.aliases)
        assert plan.upload is not None
        return dataclasses.replace(plan, input={**plan.input, plan.upload: audio}), form

    def _openai(self, url: str, body: JsonObject) -> Plan:
        if url == CHAT:
            chat = _model(ChatCompletionRequest, body)
            assert isinstance(chat, ChatCompletionRequest)
            if chat.stream:
                raise LineRefused("stream is not supported in a batch: each answer is written whole to the "
                                  "output file", "stream")
            return plan_chat(self.catalogue, chat, aliases=self.aliases)
        if url == IMAGES:
            images = _model(ImageGenerationRequest, body)
            assert isinstance(images, ImageGenerationRequest)
            return plan_images(self.catalogue, images, max_outputs=self.max_outputs, aliases=self.aliases)
        speech = _model(SpeechRequest, body)
        assert isinstance(speech, SpeechRequest)
        if speech.stream_format not in (None, "audio"):
            raise LineRefused("stream_format must be 'audio' in a batch: the speech is written whole (base64) "
                              "to the output file", "stream_format")
        return plan_speech(self.catalogue, speech, aliases=self.aliases)

    def _job(self, body: JsonObject) -> LinePlan:
        unknown = sorted(set(body) - JOB_FIELDS)
        if unknown:
            raise LineRefused(f"body.{unknown[0]}: not a field of POST /v1/jobs (it takes "
                              f"{', '.join(sorted(JOB_FIELDS))})", unknown[0])
        pipeline = body.get("pipeline")
        if not isinstance(pipeline, str) or not pipeline:
            raise LineRefused("body.pipeline is required: the name of a pipeline (GET /v1/pipelines)", "pipeline")
        if pipeline not in self.catalogue:
            raise LineRefused(f"body.pipeline: unknown pipeline {pipeline!r} (GET /v1/pipelines lists them)",
                              "pipeline", "unknown_pipeline")
        if body.get("priority", "low") != "low":
            raise LineRefused("body.priority: a batch's lines run at priority 'low'; leave it out or say 'low'",
                              "priority")
        params = body.get("params")
        try:
            self.validator.validate(pipeline, body.get("input"), params)
            self.validator.validate_webhook(body.get("webhook"), body.get("webhook_events_filter"))
        except InvalidRequest as exc:
            first = exc.errors[0]
            where = ".".join(str(p) for p in first.loc)
            raise LineRefused(f"body.{where}: {first.message}", where, first.type or "invalid_request") from None
        input_ = body.get("input")
        assert isinstance(input_, dict)  # validate refused anything else
        overrides: StageOverrides = ({k: v for k, v in params.items() if isinstance(v, dict)}
                                     if isinstance(params, dict) else {})
        return LinePlan(pipeline, input_, [overrides], None, body, body.get("webhook"),
                        body.get("webhook_events_filter"))


def read_line(index: int, raw: bytes) -> RequestLine:
    """One line's envelope checked (JSON object, custom_id, method, url, body); LineError otherwise."""
    number = index + 1
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _LineFault(LineError(number, f"is not JSON: {exc}", None, "invalid_json")) from None
    if not isinstance(value, dict):
        raise _LineFault(LineError(number, f"is a JSON {type(value).__name__}, not an object", None, "invalid_json"))
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _LineFault(LineError(number, "custom_id is missing: each line needs a string custom_id, unique in "
                                   "the file", "custom_id", "missing_custom_id"))
    method = value.get("method", "POST")
    if method != "POST":
        raise _LineFault(LineError(number, f"method is {method!r}: batch requests are POST", "method",
                                   "invalid_method"))
    url = value.get("url")
    if url not in ENDPOINTS:
        raise _LineFault(LineError(number, f"url {url!r} is not a batch endpoint: one of {', '.join(ENDPOINTS)}",
                                   "url", "invalid_url"))
    body = value.get("body")
    if not isinstance(body, dict):
        raise _LineFault(LineError(number, "body is missing: the request body, a JSON object", "body",
                                   "invalid_body"))
    assert isinstance(url, str)
    return RequestLine(index, custom_id, url, body)


class _LineFault(Exception):
    def __init__(self, error: LineError) -> None:
        super().__init__(error.message)
        self.error = error


def split_lines(data: bytes) -> list[bytes]:
    """The file's lines, blank ones (a trailing newline) left out; CRLF taken as LF."""
    return [line for line in data.split(b"\n") if line.strip()]


def iter_lines(data: bytes) -> Iterator[RequestLine]:
    """The requests of a file that was checked (check_file): its lines, in order."""
    for index, raw in enumerate(split_lines(data)):
        yield read_line(index, raw)


@dataclass(frozen=True)
class FileSummary:
    """What a checked file holds: its number of requests and the endpoints they name."""

    lines: int
    urls: frozenset[str]


def check_file(data: bytes, plan: Callable[[str, JsonObject], object], *, max_lines: int) -> FileSummary:
    """Every line checked (its envelope, a unique custom_id, its body by ``plan``); BatchFileInvalid naming
    the faulty lines, every fault counted. ``plan(url, body)`` raises LineRefused for a bad body."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        number = data[:exc.start].count(b"\n") + 1
        raise BatchFileInvalid([LineError(number, "is not UTF-8 text", None, "invalid_json")], 1) from None
    lines = split_lines(data)
    if not lines:
        raise BatchFileInvalid([LineError(1, "the file holds no requests (one JSON object per line)", None,
                                          "empty_file")], 1)
    if len(lines) > max_lines:
        raise BatchFileInvalid([LineError(max_lines + 1, f"the file has {len(lines)} requests; at most {max_lines} "
                                          "(OMNI_BATCH_FILE_MAX_LINES): split it into several batches", None,
                                          "too_many_lines")], 1)
    errors: list[LineError] = []
    seen: dict[str, int] = {}
    urls: set[str] = set()
    for index, raw in enumerate(lines):
        try:
            line = read_line(index, raw)
        except _LineFault as fault:
            errors.append(fault.error)
            continue
        earlier = seen.get(line.custom_id)
        if earlier is not None:
            errors.append(LineError(index + 1, f"custom_id {line.custom_id!r} is repeated (first on line {earlier}); "
                                    "each line's custom_id is unique in the file", "custom_id", "duplicate_custom_id"))
            continue
        seen[line.custom_id] = index + 1
        urls.add(line.url)
        try:
            plan(line.url, line.body)
        except LineRefused as exc:
            param = f"body.{exc.param}" if exc.param and not exc.param.startswith("body.") else exc.param
            errors.append(LineError(index + 1, exc.message, param, exc.code))
    if errors:
        raise BatchFileInvalid(errors[:MAX_REPORTED_ERRORS], len(errors))
    return FileSummary(len(lines), frozenset(urls))
