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
from omni_jobs.errors import FieldError, InvalidRequest
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.spec import DEFAULT_MAX_IMAGE_BYTES

JSON_FIELDS = ("input", "params", "webhook_events_filter")
TEXT_FIELDS = ("pipeline", "webhook")

OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["pipeline"],
                    "properties": {
                        "pipeline": {"type": "string", "examples": ["image-to-image"]},
                        "input": {"type": "string", "description": 'JSON object of the other inputs, e.g. {"prompt": "..."}'},
                        "params": {"type": "string", "description": "JSON object of per-stage overrides"},
                        "webhook": {"type": "string"},
                        "webhook_events_filter": {"type": "string", "description": 'JSON list, e.g. ["completed"]'},
                        "input.image": {"type": "string", "format": "binary",
                                        "description": "A file input; name each file part input.<field>"},
                    },
                    "patternProperties": {r"^input\..+$": {"type": "string", "format": "binary"}},
                    "additionalProperties": False,
                }
            }
        },
    }
}


def _json(name: str, text: str) -> Any:
    try:
        return json.loads(text)
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
        limit = DEFAULT_MAX_IMAGE_BYTES
        if spec is not None and name in spec.inputs:
            limit = spec.inputs[name].max_bytes or DEFAULT_MAX_IMAGE_BYTES
        inputs[name] = await upload.read(limit + 1)  # one byte over the limit is enough to refuse it
    try:
        return JobRequest.model_validate(fields)
    except ValidationError as exc:
        raise InvalidRequest([FieldError(tuple(str(p) for p in e["loc"]), e["msg"], e["type"])
                              for e in exc.errors()]) from None
