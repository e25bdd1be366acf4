"""multipart/form-data job submissions: the same request as the JSON body, with files as parts.

Form fields: ``pipeline``; ``input``, ``params``, ``webhook_events_filter`` as JSON text; ``webhook``.
Each file part named ``input.<field>`` (or just ``<field>``) becomes that input's value as raw
bytes, which the submitter validates and stores like base64 data. Uploads are read up to the
field's size limit and no further.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request

from api.schemas import JobRequest
from omni_jobs.core import jsontext
from omni_jobs.core.errors import FieldError, InvalidRequest
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.limits import Limits
from omni_jobs.pipelines.schema import WHAT_DECODES, input_schema
from omni_jobs.pipelines.spec import DEFAULT_MAX_BYTES, PipelineSpec

JSON_FIELDS = ("input", "params", "webhook_events_filter")
TEXT_FIELDS = ("pipeline", "webhook")

_JSON_TEXT = {"contentType": "application/json"}
OPENAPI: dict[str, Any] = {"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": {"type": "object", "required": ["pipeline"], "properties": {
        "pipeline": {"type": "string", "examples": ["image-to-image"]},
        "input": {"type": "object", "description": 'JSON object of the other inputs, e.g. {"prompt": "..."}'},
        "params": {"type": "object", "description": "JSON object of per-stage overrides"},
        "webhook": {"type": "string"},
        "webhook_events_filter": {"type": "array", "items": {"type": "string"}, "description": 'e.g. ["completed"]'},
    }},
    "encoding": {name: _JSON_TEXT for name in JSON_FIELDS},
}}}}
"""The form as the route declares it; api.main replaces its schema with request_body's, per pipeline."""

_FILE = {"type": "string", "format": "binary", "description": "A file input: a part named input.<field>."}
_FILE_OF = {kind: {**_FILE, "description": f"A file input, {what}: a part named input.<field>."}
            for kind, what in WHAT_DECODES.items()}


def _branch(spec: PipelineSpec, limits: Limits, file_parts: set[str], json_body: dict[str, Any]) -> dict[str, Any]:
    """The form of one pipeline: its input object (each file input in it, or as a part input.<name>, not
    both), its params as in JSON (``json_body``: its JobRequest.<name>), and no file part that is not
    one of its file inputs (image, audio, video)."""
    images = set(spec.file_inputs())
    inputs = input_schema(spec, limits)
    inputs["required"] = [name for name in inputs["required"] if name not in images]
    properties: dict[str, Any] = {"pipeline": {"const": spec.name}, "input": inputs,
                                  "params": json_body["properties"]["params"],
                                  **{part: _FILE_OF[spec.inputs[part.removeprefix("input.")].type]
                                     if part.removeprefix("input.") in images else False for part in sorted(file_parts)}}
    rules: list[dict[str, Any]] = []
    # As a file part, or in the input JSON (if at all), not both. No "not" (schemathesis 4.32 judges
    # those on the file's bytes, which it cannot), and every schema typed (it puts its constants
    # where a schema has no type, and cannot check the whole form then).
    for name in sorted(images):
        as_file = {"required": [f"input.{name}"], "properties": {"input": {"type": "object", "properties": {name: False}}}}
        in_json: dict[str, Any] = {"properties": {f"input.{name}": False}}
        if spec.inputs[name].required and spec.inputs[name].default is None:
            in_json = {"required": ["input"],
                       "properties": {f"input.{name}": False, "input": {"type": "object", "required": [name]}}}
        rules.append({"anyOf": [as_file, in_json]})
    required = ["pipeline", *(["input"] if inputs["required"] else []),
                *(["params"] if "params" in json_body["required"] else [])]
    branch: dict[str, Any] = {"title": f"{spec.name} (form)", "properties": properties, "required": required}
    if rules:
        branch["allOf"] = rules
    return branch


def request_body(json_bodies: dict[str, dict[str, Any]], catalogue: PipelineCatalogue, limits: Limits, *,
                 webhooks: bool) -> dict[str, Any]:
    """The form's OpenAPI requestBody: the fields of POST /v1/jobs (``json_bodies``: its JobRequest.<name>
    schemas) as parts, input, params and webhook_events_filter as JSON text, and one anyOf branch per
    pipeline (its pipeline const tells them apart). Every field is listed at the top too, so a client knows which parts are files."""
    file_parts = {f"input.{name}" for spec in catalogue for name in spec.file_inputs()}
    any_body = next(iter(json_bodies.values()))["properties"]
    properties: dict[str, Any] = {
        "pipeline": {"type": "string", "enum": catalogue.names(), "examples": ["image-to-image"]},
        "input": {"type": "object", "description": 'JSON text of the inputs, e.g. {"prompt": "..."}; file inputs '
                  "(image, audio, video) may come as parts named input.<field> instead",
                  "examples": [{"prompt": "make it blue"}]},
        "params": {"anyOf": [{"type": "object"}, {"type": "null"}], "description": "JSON text of per-stage overrides"},
        **({"webhook": any_body["webhook"]} if webhooks else {}),
        "webhook_events_filter": any_body["webhook_events_filter"],
        **{part: _FILE for part in sorted(file_parts)},
    }
    # anyOf, not oneOf: the branches exclude each other by their pipeline const already, and schemathesis
    # (4.32) checks a oneOf's "exactly one" on what it drew, file parts included, whose bytes it cannot
    # judge (it failed so on a pipeline with two file inputs).
    schema = {"type": "object", "required": ["pipeline"], "properties": properties, "additionalProperties": False,
              "anyOf": [_branch(spec, limits, file_parts, json_bodies[spec.name]) for spec in catalogue]}
    if webhooks:  # a filter without a webhook is refused
        schema.update({key: rule for key, rule in next(iter(json_bodies.values())).items() if key in ("if", "then")})
    example = {"pipeline": "text-to-image", "input": {"prompt": "a red fox in the snow"}}
    return {"required": True, "content": {"multipart/form-data": {
        "schema": schema, "encoding": {name: _JSON_TEXT for name in JSON_FIELDS},
        **({"example": example} if example["pipeline"] in catalogue else {})}}}


def _json(name: str, text: str) -> Any:
    try:
        return jsontext.loads(text)  # nesting past its limit is a JSONDecodeError, not a RecursionError
    except json.JSONDecodeError as exc:
        raise InvalidRequest([FieldError((name,), f"is not valid JSON: {exc.msg}", "json_invalid")]) from None


async def job_request_from_form(request: Request, catalogue: PipelineCatalogue) -> JobRequest:
    """The JobRequest a multipart form describes; InvalidRequest names every bad part."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise InvalidRequest([FieldError(("header", "content-type"), f"must be multipart/form-data, got "
                                         f"{content_type!r}; send JSON to POST /v1/jobs instead", "content_type")])
    form = await request.form()
    fields: dict[str, Any] = {}
    files: dict[str, UploadFile] = {}
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            files[key.removeprefix("input.")] = value
        elif key in JSON_FIELDS:
            fields[key] = _json(key, value)
        elif key in TEXT_FIELDS:
            fields[key] = value
        else:
            raise InvalidRequest([FieldError((key,), f"unknown form field; fields: {[*TEXT_FIELDS, *JSON_FIELDS]}, "
                                             "and files named input.<field>", "extra")])
    inputs = fields.setdefault("input", {})
    if not isinstance(inputs, dict):
        raise InvalidRequest([FieldError(("input",), "must be a JSON object", "type_error")])
    spec = catalogue.get(str(fields.get("pipeline", ""))) if "pipeline" in fields else None
    for name, upload in files.items():
        if name in inputs:
            raise InvalidRequest([FieldError(("input", name), "given both as a file and in the input JSON", "extra")])
        limit = max(DEFAULT_MAX_BYTES.values())  # a part no file input takes is refused after the read
        if spec is not None and name in spec.inputs and spec.inputs[name].is_file:
            limit = spec.inputs[name].byte_limit
        inputs[name] = await upload.read(limit + 1)  # one byte over the limit is enough to refuse it
    try:
        return JobRequest.model_validate(fields)
    except ValidationError as exc:
        raise InvalidRequest([FieldError(tuple(str(p) for p in e["loc"]), e["msg"], e["type"])
                              for e in exc.errors()]) from None
