"""Chat messages with media: the content parts that OpenAI's and vLLM's chat bodies carry (``image_url``,
``input_audio``, ``audio_url``, ``video_url``) mapped onto a pipeline's file inputs, as pure functions.

A chat request names no input fields: its messages carry text, and its user messages media parts. A
pipeline offers a chat what its job inputs are (content_inputs): one text input for the messages'
text, and the image, audio and video inputs its stages read, each kind in the order the stages take
them (required ones first). The first image part goes to the first image input, the second to the next one (a
stage port wired to several: ``image: [input.front, input.back]``). A part reaches the job as the
value that file input takes in POST /v1/jobs: a data: URI or a stored output's URL as it is, input
audio's base64 as ``{"data": ...}``. The submitter decodes and stores it as for any job, and its
refusal names the part it came from (media_input's origin).

The schema of the messages a pipeline takes (messages_schema) is built from the same tables, so that
the spec says what read_content and the counts accept; whether the bytes decode is what no schema
can say.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.core.json_types import JsonObject, JsonValue
from omni_jobs.pipelines.schema import NOT_BLANK
from omni_jobs.pipelines.spec import INPUT_SOURCE, PipelineSpec

FileKind = Literal["image", "audio", "video"]
FILE_KINDS: tuple[FileKind, ...] = ("image", "audio", "video")
PART_KINDS: dict[str, FileKind] = {"image_url": "image", "input_audio": "audio", "audio_url": "audio",
                                   "video_url": "video"}
"""Each media part's type and the kind of file input it fills (vLLM's names; OpenAI's are image_url and input_audio)."""
KIND_PARTS: dict[str, tuple[str, ...]] = {kind: tuple(p for p, k in PART_KINDS.items() if k == kind) for kind in FILE_KINDS}
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm")
"""``input_audio.format``: formats FFmpeg finds by their headers (the bytes decide; raw pcm16 has none)."""
IMAGE_DETAILS = ("auto", "low", "high")
"""``image_url.detail``: taken and not used (the model sees the image as its processor sizes it)."""
_A = {"image": "an image", "audio": "an audio", "video": "a video"}


def a_kind(kind: str) -> str:
    """'an image', 'an audio', 'a video': a part of that kind, in words."""
    return _A.get(kind, f"a {kind}")


# --- the parts, as the request model takes them ---
_TEXT: JsonObject = {"type": "string", "pattern": NOT_BLANK}  # some text, not only whitespace
_URL: JsonObject = {"type": "string", "minLength": 1}


def part_schema(part_type: str, text: JsonObject | None = None) -> JsonObject:
    """One content part as read_content takes it (``text``: the schema of a text part's text)."""
    body: JsonObject
    if part_type == "text":
        body = text or _TEXT
    elif part_type == "input_audio":
        body = {"type": "object", "required": ["data", "format"],
                "properties": {"data": {**_URL, "description": "The clip's bytes in base64."},
                               "format": {"type": "string", "enum": [*AUDIO_FORMATS]}}}
    else:
        url: JsonObject = {"type": "object", "required": ["url"], "properties": {"url": _URL}}
        if part_type == "image_url":
            url["properties"] = {"url": _URL, "detail": {"enum": [*IMAGE_DETAILS]}}
        body = {"anyOf": [_URL, url], "description": "A data: URI (base64) or the URL of an output this system "
                "stores (.../v1/jobs/{id}/outputs/{name}); nothing is fetched from elsewhere."}
    return {"type": "object", "required": ["type", part_type],
            "properties": {"type": {"type": "string", "enum": [part_type]}, part_type: body}}


MESSAGE_CONTENT: JsonObject = {"anyOf": [
    _TEXT,
    {"type": "array", "minItems": 1, "items": {"anyOf": [part_schema(p) for p in ("text", *PART_KINDS)]}},
]}
"""What read_content accepts of any message (it answers 400 naming the message or part otherwise);
the spec says, per pipeline, which media parts and how many (messages_schema)."""


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: Annotated[str | list[JsonObject], WithJsonSchema(MESSAGE_CONTENT)] = Field(
        description="The message's text, or its parts: text, and in user messages the media the pipeline takes "
                    "(image_url, input_audio, audio_url, video_url).")


# --- reading the messages ---
@dataclass(frozen=True)
class MediaPart:
    """One media part: the kind of input it fills, its type, the job input's value, and where it was."""

    kind: FileKind
    part_type: str
    value: JsonValue
    param: str
    """``messages[i].content[j]``: what a 400 about it names."""


@dataclass(frozen=True)
class ChatContent:
    """What the messages say: the prompt (None when no message holds text) and the media parts in order."""

    prompt: str | None
    media: tuple[MediaPart, ...] = ()

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(part.kind for part in self.media)


def _part_value(part: JsonObject, part_type: str, param: str) -> JsonValue:
    """The job input's value of one media part; 400 naming the field of the part that is wrong."""
    body = part.get(part_type)
    at = f"{param}.{part_type}"
    if part_type == "input_audio":
        if not isinstance(body, dict):
            raise OpenAIError(400, "input_audio must be an object {data: <base64>, format}", param=at)
        data, audio_format = body.get("data"), body.get("format")
        if not isinstance(data, str) or not data:
            raise OpenAIError(400, "input_audio.data must be the clip's bytes in base64", param=f"{at}.data")
        if audio_format not in AUDIO_FORMATS:
            raise OpenAIError(400, f"input_audio.format must be one of {', '.join(AUDIO_FORMATS)}, got "
                              f"{audio_format!r}", param=f"{at}.format")
        return {"data": data}
    url: JsonValue
    if isinstance(body, str):
        url, url_at = body, at
    elif isinstance(body, dict):
        url, url_at = body.get("url"), f"{at}.url"
        if part_type == "image_url" and "detail" in body and body["detail"] not in IMAGE_DETAILS:
            raise OpenAIError(400, f"image_url.detail must be one of {', '.join(IMAGE_DETAILS)}", param=f"{at}.detail")
    else:
        raise OpenAIError(400, f"{part_type} must be a URL or an object {{url}}", param=at)
    if not isinstance(url, str) or not url:
        raise OpenAIError(400, f"{part_type} needs a url: a data: URI (base64) or the URL of an output this system "
                          "stores", param=url_at)
    return url


def read_content(messages: Sequence[ChatMessageIn]) -> ChatContent:
    """The prompt and the media of the messages. The prompt: one message with text, its text; several, a
    transcript ('User: ...', 'Assistant: ...') ending with 'Assistant:'. A user message may hold media
    parts only (it adds no line); any other message must hold text, and every text part some."""
    turns: list[tuple[str, str]] = []
    media: list[MediaPart] = []
    for i, message in enumerate(messages):
        content = message.content
        where = f"messages[{i}].content"
        if isinstance(content, str):
            if not content.strip():
                raise OpenAIError(400, "the message holds no text", param=where)
            turns.append((message.role, content))
            continue
        if not content:
            raise OpenAIError(400, "content has no parts", param=where)
        texts: list[str] = []
        for j, part in enumerate(content):
            part_type = part.get("type")
            param = f"{where}[{j}]"
            if part_type == "text":
                text = part.get("text")
                if not isinstance(text, str) or not text.strip():
                    raise OpenAIError(400, "a text part holds no text", param=f"{param}.text")
                texts.append(text)
            elif isinstance(part_type, str) and part_type in PART_KINDS:
                if message.role != "user":
                    raise OpenAIError(400, f"{part_type} parts are taken in user messages only, not in a "
                                      f"'{message.role}' message", param=param, code="unsupported_content")
                media.append(MediaPart(PART_KINDS[part_type], part_type, _part_value(part, part_type, param), param))
            else:
                raise OpenAIError(400, f"content part of type {part_type!r}: these endpoints take parts of type "
                                  f"text, {', '.join(PART_KINDS)}", param=param, code="unsupported_content")
        if texts:
            turns.append((message.role, "\n".join(texts)))
    if not turns:
        return ChatContent(None, tuple(media))
    if len(turns) == 1:
        return ChatContent(turns[0][1], tuple(media))
    lines = [f"{role.capitalize()}: {text}" for role, text in turns]
    return ChatContent("\n".join([*lines, "Assistant:"]), tuple(media))


# --- what a pipeline takes ---
@dataclass(frozen=True)
class ContentInputs:
    """The job inputs a chat fills: ``text`` (the messages' text), and per kind the file inputs in the
    order parts fill them (required ones first, then as the stages take them); ``required``: how many of
    each kind the job needs."""

    text: str
    text_required: bool
    slots: Mapping[str, tuple[str, ...]]
    required: Mapping[str, int]

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(kind for kind, names in self.slots.items() if names)


def content_inputs(spec: PipelineSpec) -> ContentInputs | None:
    """What a chat can fill of ``spec``: None unless it has one text input (``prompt``, or its only one)
    and needs no input other than text and the files (image, audio, video) its stages read. A file input
    no stage reads takes no part."""
    texts = [n for n, f in spec.inputs.items() if f.type == "text"]
    text = "prompt" if "prompt" in texts else (texts[0] if len(texts) == 1 else None)
    if text is None:
        return None
    if any(n != text and f.type not in FILE_KINDS and f.required and f.default is None
           for n, f in spec.inputs.items()):
        return None
    wired: list[str] = []  # the job inputs the stages read, in the order they read them
    for stage in spec.stages:
        for _port, binding in stage.bindings():
            if binding.source == INPUT_SOURCE and binding.port not in wired:
                wired.append(binding.port)
    files = [n for n in wired if spec.inputs[n].type in FILE_KINDS]
    if any(f.type in FILE_KINDS and f.required and n not in wired for n, f in spec.inputs.items()):
        return None  # a file no stage reads: no part is meant for it
    needed = {n for n in files if spec.inputs[n].required and spec.inputs[n].default is None}
    files.sort(key=lambda n: n not in needed)  # stable: required first, each group in the stages' order
    field = spec.inputs[text]
    return ContentInputs(
        text=text, text_required=field.required and field.default is None,
        slots={kind: tuple(n for n in files if spec.inputs[n].type == kind) for kind in FILE_KINDS},
        required={kind: sum(spec.inputs[n].type == kind for n in needed) for kind in FILE_KINDS})


def first_misfit(inputs: ContentInputs, media: Sequence[MediaPart]) -> tuple[MediaPart, int] | None:
    """The first part ``inputs`` has no input left for, and how many of its kind it makes (1: the first)."""
    seen: Counter[str] = Counter()
    for part in media:
        seen[part.kind] += 1
        if seen[part.kind] > len(inputs.slots.get(part.kind, ())):
            return part, seen[part.kind]
    return None


def missing_kinds(inputs: ContentInputs, media: Sequence[MediaPart]) -> dict[str, int]:
    """Kind -> how many parts of it the pipeline needs, for each kind the messages hold too few of."""
    given: Counter[str] = Counter(part.kind for part in media)
    return {kind: n for kind, n in inputs.required.items() if given[kind] < n}


def media_input(inputs: ContentInputs, content: ChatContent) -> tuple[JsonObject, dict[str, str]]:
    """The job input (the prompt, when the messages hold text, and each part in the next input of its
    kind; first_misfit found none left over) and, per file input, the part it came from."""
    job_input: JsonObject = {} if content.prompt is None else {inputs.text: content.prompt}
    origin: dict[str, str] = {}
    used: Counter[str] = Counter()
    for part in content.media:
        name = inputs.slots[part.kind][used[part.kind]]
        used[part.kind] += 1
        job_input[name] = part.value
        origin[name] = part.param
    return job_input, origin


# --- the messages a pipeline takes, as a schema ---
def _part_of(part_types: Sequence[str]) -> JsonObject:
    """A part of one of these types."""
    return {"type": "object", "required": ["type"], "properties": {"type": {"enum": [*part_types]}}}


def _has_part(part_types: Sequence[str]) -> JsonObject:
    """A message whose content holds a part of one of these types."""
    return {"type": "object", "required": ["content"], "properties": {"content": {
        "type": "array", "contains": _part_of(part_types)}}}


def messages_schema(base: JsonObject, text: JsonObject, inputs: ContentInputs, kinds: frozenset[str],
                    needed: Mapping[str, int]) -> JsonObject:
    """``messages`` (``base``: the request model's) when the request runs with ``inputs``: each text as
    ``text``; media parts of ``kinds`` in user messages, at most as many of each kind as there are inputs
    of it and at least ``needed``; some text when the text input is required.

    The counts are across messages: exact where a pipeline has one input of a kind (at most one message
    holds one, with one), as every built-in pipeline has; with several, the schema allows them spread
    over as many messages, which read_content's count may then refuse (400)."""
    text_only: JsonObject = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string"},
        "content": {"anyOf": [text, {"type": "array", "minItems": 1, "items": part_schema("text", text)}]}}}
    message: JsonObject = text_only
    rules: list[JsonValue] = []
    kinds_in_order = [kind for kind in FILE_KINDS if kind in kinds]
    if kinds_in_order:
        parts: list[JsonValue] = [part_schema("text", text),
                                  *(part_schema(p) for k in kinds_in_order for p in KIND_PARTS[k])]
        per_message: list[JsonValue] = [
            {"contains": _part_of(KIND_PARTS[k]), "minContains": 0, "maxContains": len(inputs.slots[k])}
            for k in kinds_in_order]
        with_media: JsonObject = {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"type": "string", "enum": ["user"]},
            "content": {"type": "array", "minItems": 1, "items": {"anyOf": parts}, "allOf": per_message}}}
        message = {"anyOf": [text_only, with_media]}
        for kind in kinds_in_order:
            rules.append({"contains": _has_part(KIND_PARTS[kind]), "minContains": min(1, needed.get(kind, 0)),
                          "maxContains": len(inputs.slots[kind])})
    if inputs.text_required:
        rules.append({"contains": {"type": "object", "required": ["content"], "properties": {"content": {
            "anyOf": [{"type": "string"}, {"type": "array", "contains": _part_of(["text"])}]}}}})
    schema: JsonObject = {**base, "items": message}
    if rules:
        schema["allOf"] = rules
    return schema
