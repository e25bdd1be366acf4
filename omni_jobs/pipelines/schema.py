"""Pipelines as JSON schemas, for the OpenAPI spec (api.main builds it from the catalogue): a job's
``input`` and ``params`` for each pipeline, with the same rules that omni_jobs.accept.submission checks
(validate_input, resolve_params) and this server's caps (omni_jobs.pipelines.limits)."""

from __future__ import annotations

from typing import Literal, TypedDict

from omni_jobs.core.json_types import JsonObject, JsonValue
from omni_jobs.pipelines.limits import PARAM_CAPS, Limits
from omni_jobs.pipelines.spec import InputField, PipelineSpec, StageSpec

FORMS = ("a data: URI, base64 data, a URL of a stored output (.../v1/jobs/{id}/outputs/{name}), or an object "
         "{data} | {url} | {job_id, output} | {artifact}")
"""The forms a file input takes (the schema's description, and omni_jobs.media.input_files' errors)."""


def json_object(value: JsonValue, what: str = "value") -> JsonObject:
    """``value`` narrowed to a JSON object (a schema's part, from pydantic or built here): TypeError if it is not."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} is not a JSON object: {type(value).__name__}")
    return value


NOT_BLANK = "[^" + "".join(f"\\u{c:04x}" for c in range(0x3001) if chr(c).isspace()) + "]"
"""A pattern for "some text that is not only whitespace", with str.strip's whitespace spelled out
(there is none above U+3000): regex engines do not agree on what \\s is (U+001C, U+0085, U+FEFF)."""
WHAT_DECODES = {"image": "an image (PNG, JPEG, WebP...)",
                "audio": "audio (WAV, FLAC, MP3, OGG Vorbis or Opus, M4A/AAC, WebM...)",
                "video": "a video (MP4/MOV, WebM, Matroska, AVI)"}
"""What a file input's bytes must be, in words (the schema's description)."""


def _file_object(keys: tuple[str, ...]) -> JsonObject:
    """A file given as an object with exactly the string fields ``keys``."""
    return {"type": "object", "properties": {key: {"type": "string"} for key in keys}, "required": [*keys],
            "additionalProperties": False}


def _file_schema(kind: str, what: str, example: str) -> JsonObject:
    """What parse_file_value takes for a ``kind`` input (its shapes; whether the bytes decode is found
    when they are prepared)."""
    return {
        "description": f"{what}: {FORMS}. It must decode as {WHAT_DECODES[kind]}, which a schema cannot "
                       f"say: a value that does not is a 422 (invalid_{kind}).",
        "anyOf": [
            {"type": "string", "minLength": 1},
            *(_file_object(keys) for keys in (("data",), ("url",), ("job_id", "output"))),
            {"type": "object", "properties": {"artifact": {"type": "object"}}, "required": ["artifact"],
             "additionalProperties": False},
        ],
        "examples": [example],
    }


IMAGE_SCHEMA: JsonObject = _file_schema("image", "An image", "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAAAA"
                                        "AA6fptVAAAACklEQVR4nGNgAAAAAgABSK+kcQAAAABJRU5ErkJggg==")
AUDIO_SCHEMA: JsonObject = _file_schema("audio", "Audio (stored as a 16-bit WAV at its own rate)",
                                        "data:audio/wav;base64,UklGRjQAAABXQVZFZm10IBAAAAABAAEAgD4AAAB9AAACABAAZG"
                                        "F0YRAAAAAAAAAAAAAAAAAAAAAAAAAA")
VIDEO_SCHEMA: JsonObject = _file_schema("video", "A video (stored as an H.264 MP4)",
                                        "http://127.0.0.1:8000/v1/jobs/job_0a1b2c3d/outputs/video")
FILE_SCHEMAS: dict[str, JsonObject] = {"image": IMAGE_SCHEMA, "audio": AUDIO_SCHEMA, "video": VIDEO_SCHEMA}


def input_field_schema(field: InputField, *, max_text_chars: int | None = None) -> JsonObject:
    """The JSON schema of the values validate_input (omni_jobs.accept.submission) accepts for ``field`` (``max_text_chars``:
    this server's cap on text, Limits.check_input)."""
    if field.is_file:
        return {**FILE_SCHEMAS[field.type]}
    if field.type != "text":
        return {"type": field.type}
    schema: JsonObject = {"type": "string"}
    if field.choices is not None:
        schema["enum"] = list(field.choices)
        return schema
    caps = [n for n in (field.max_length, max_text_chars) if n is not None]
    if caps:
        schema["maxLength"] = min(caps)
    if field.required:
        schema["pattern"] = NOT_BLANK
    return schema


class InputSchema(TypedDict):
    """The JSON schema of a job's ``input`` (input_schema): an object whose required fields are listed."""

    type: Literal["object"]
    title: str
    properties: JsonObject
    required: list[str]
    additionalProperties: bool


def input_schema(spec: PipelineSpec, limits: Limits | None = None) -> InputSchema:
    """The JSON schema of a job's ``input`` for ``spec``: what validate_input (and the limits) accept.
    A field that is optional or has a default may be null (it then takes its default)."""
    properties: JsonObject = {}
    required: list[str] = []
    for name, field in spec.inputs.items():
        schema = input_field_schema(field, max_text_chars=limits.max_prompt_chars if limits else None)
        if field.required and field.default is None:
            required.append(name)
        else:
            schema = {"anyOf": [schema, {"type": "null"}]}
            if field.default is not None:
                schema["default"] = field.default
        if field.description:
            schema["description"] = field.description.strip()
        properties[name] = schema
    return {"type": "object", "title": f"{spec.name} input", "properties": properties, "required": required,
            "additionalProperties": False}


def _cap(schema: JsonObject, cap: int) -> JsonObject:
    """``schema`` with its maximum lowered to ``cap`` (in each branch of an anyOf)."""
    if "anyOf" in schema:
        branches = schema["anyOf"]
        if not isinstance(branches, list):
            raise TypeError(f"anyOf is not a list: {type(branches).__name__}")
        return {**schema, "anyOf": [_cap(json_object(branch, "an anyOf branch"), cap) for branch in branches]}
    if schema.get("type") not in ("integer", "number"):
        return schema
    maximum = schema.get("maximum", cap)
    if not isinstance(maximum, int | float) or isinstance(maximum, bool):
        raise TypeError(f"maximum is not a number: {maximum!r}")
    return {**schema, "maximum": min(maximum, cap)}


def stage_params_schema(stage: StageSpec, limits: Limits | None = None) -> JsonObject:
    """The JSON schema of a job's overrides for ``stage``: its parameter model's (the one resolve_params
    validates with), with the stage's own defaults and this server's caps (Limits.check_params). A
    default above a cap is required: the job must lower it. Rules across fields stay in the
    description (e.g. image-to-image: strength x num_inference_steps >= 1)."""
    model: JsonObject = stage.params_model.model_json_schema()  # pydantic types it dict[str, Any]
    assert "$defs" not in model, f"{stage.params_model.__name__}: nested models are not inlined here"
    properties: JsonObject = {}
    required: list[JsonValue] = []
    for name, value in json_object(model["properties"], "properties").items():
        prop = json_object(value, name)
        default = stage.defaults.get(name, prop.get("default"))
        cap_of = PARAM_CAPS.get(name)
        if cap_of is not None and limits is not None:
            cap: int = getattr(limits, cap_of[0])
            prop = _cap(prop, cap)
            if isinstance(default, int | float) and default > cap:
                required.append(name)
        properties[name] = {**prop, "default": default} if "default" in prop or name in stage.defaults else prop
    schema: JsonObject = {"type": "object", "title": f"{stage.id} ({stage.params_model.__name__})",
                              "properties": properties, "additionalProperties": False}
    if model.get("description"):
        schema["description"] = model["description"]
    if required:
        schema["required"] = required
    return schema


def params_schema(spec: PipelineSpec, limits: Limits | None = None) -> JsonObject:
    """The JSON schema of a job's ``params`` for ``spec``: overrides keyed by stage id."""
    stages = {stage.id: stage_params_schema(stage, limits) for stage in spec.stages}
    schema: JsonObject = {"type": "object", "title": f"{spec.name} params", "properties": {**stages},
                          "additionalProperties": False}
    required: list[JsonValue] = [sid for sid, stage in stages.items() if stage.get("required")]
    if required:
        schema["required"] = required
    return schema
