"""A JSON request body read and validated the way FastAPI does it, for a route that reads its own.

POST /v1/jobs takes only the request and calls these: FastAPI's per-request work for a body model
and four dependencies (the body's content-type parse, the dependency solver, the response object)
was about a sixth of a submit's CPU in the API (0.07 of 0.46 ms, driven in-process). The answers are
FastAPI's: a body that is not JSON is a 422 ``json_invalid`` at ``("body", position)``, one that
cannot be decoded a 400, a missing or wrong body a 422 with each error's ``loc`` under ``"body"``.
"""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from omni_jobs.core import jsontext

M = TypeVar("M", bound=BaseModel)


def _is_json(content_type: str) -> bool:
    """application/json or application/*+json, parameters ignored (what FastAPI reads as JSON)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_json(request: Request) -> object:
    """The body: its JSON value when the content type says JSON, else its bytes (which no model
    accepts: FastAPI's strict content type), None when it is empty."""
    raw = await request.body()
    if not raw:
        return None
    content_type = request.headers.get("content-type")
    if not content_type or not _is_json(content_type):
        return raw
    try:
        return jsontext.loads(raw)  # orjson; on an error the standard library reads it again, for its message
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}], body=exc.doc) from exc
    except ValueError as exc:  # not UTF-8 (or -16/-32) text
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from exc


def validate_body(model: type[M], value: object) -> M:
    """``value`` (from read_json) as ``model``; every error at once, located under ``body``."""
    if value is None:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return model.model_validate(value, from_attributes=True)
    except ValidationError as exc:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])}
                                      for error in exc.errors(include_url=False)], body=value) from None
