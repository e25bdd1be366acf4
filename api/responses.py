"""The API's JSON answers, written by omni_jobs.core.jsontext (orjson) instead of the standard library."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from omni_jobs.core import jsontext


class JSONText(JSONResponse):
    """A JSONResponse, compact and UTF-8 as Starlette's, rendered ~10x faster: the job object of every
    submit and read. NaN is null here (Starlette's answered 500); see omni_jobs.core.jsontext."""

    def render(self, content: Any) -> bytes:
        return jsontext.dumps_bytes(content)
