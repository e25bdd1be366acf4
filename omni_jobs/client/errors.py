"""The API's error answers as exceptions: one class per status a caller handles differently.

Both error bodies the API sends are read, so ``str(err)`` names the problem either way: its own
``{"detail": ...}`` (a message; for a 422 the list of wrong fields; a 429 adds ``limit`` and
``value``) and the OpenAI routes' ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import email.utils
import json
import re
import time
from collections.abc import Mapping
from typing import Any


class ApiError(Exception):
    """The API answered with an error status.

    ``detail`` is the body's ``detail`` (the API's own shape), or its ``error`` object (the OpenAI
    routes' shape), or else the body as text; ``body`` is the whole body as parsed (None when it
    is not JSON). ``code``, ``type`` and ``param`` are the OpenAI shape's, when the body has it."""

    def __init__(self, status_code: int, detail: Any, *, method: str = "", url: str = "", body: Any = None,
                 headers: Mapping[str, str] | None = None) -> None:
        self.status_code = status_code
        self.detail = detail
        self.method = method
        self.url = url
        self.body = body
        self.headers: dict[str, str] = {k.lower(): v for k, v in (headers or {}).items()}
        openai = detail if isinstance(detail, dict) else {}
        self.code: str | None = _text(openai.get("code"))
        self.type: str | None = _text(openai.get("type"))
        self.param: str | None = _text(openai.get("param"))
        super().__init__(f"{method} {url} -> {status_code}: {self.describe(detail)}".strip())

    @property
    def message(self) -> str:
        """What went wrong, in one line (``str(err)`` adds the method, URL and status)."""
        return self.describe(self.detail)

    @staticmethod
    def describe(detail: Any) -> str:
        """One line for a ``detail``: the message, each wrong field (422), or OpenAI's message [code]."""
        if isinstance(detail, list):  # 422: [{"loc": [...], "msg": ...}]
            return "; ".join(f"{_loc(d)}: {d.get('msg')}" if isinstance(d, dict) else str(d) for d in detail)
        if isinstance(detail, dict) and "message" in detail:  # {"error": {"message", "code", ...}}
            code = detail.get("code")
            return f"{detail['message']} [{code}]" if code else str(detail["message"])
        return str(detail)


class InvalidRequestError(ApiError):
    """422 (or 400): the request is wrong; ``fields`` maps each wrong field to its message, e.g.
    'body.input.prompt' (the API's 422) or 'messages' (an OpenAI route's ``param``)."""

    @property
    def fields(self) -> dict[str, str]:
        if isinstance(self.detail, list):
            return {_loc(d): str(d.get("msg")) for d in self.detail if isinstance(d, dict)}
        if self.param:
            return {self.param: self.message}
        return {}


class UnauthorizedError(ApiError):
    """401: no API key, or one that is unknown or revoked (send ``api_key=`` or set OMNI_API_KEY)."""


class NotFoundError(ApiError):
    """404: no such job (or output), or it belongs to another tenant."""


class ConflictError(ApiError):
    """409: e.g. canceling a job that already ended, or an Idempotency-Key reused with another body."""


class RateLimitedError(ApiError):
    """429: a tenant quota was reached. ``limit`` names it (max_active or jobs_per_minute), ``value``
    is its value for this tenant (the OpenAI routes do not send it), ``retry_after_s`` says when to
    try again (the Retry-After header)."""

    def __init__(self, status_code: int, detail: Any, *, retry_after_s: float | None = None,
                 limit: str | None = None, value: int | None = None, **kw: Any) -> None:
        super().__init__(status_code, detail, **kw)
        self.retry_after_s = retry_after_s
        self.limit = limit
        self.value = value


class UnavailableError(ApiError):
    """503: overloaded or a backing service is down; ``retry_after_s`` says when to try again."""

    def __init__(self, status_code: int, detail: Any, *, retry_after_s: float | None = None, **kw: Any) -> None:
        super().__init__(status_code, detail, **kw)
        self.retry_after_s = retry_after_s


ERRORS: dict[int, type[ApiError]] = {400: InvalidRequestError, 401: UnauthorizedError, 404: NotFoundError,
                                     409: ConflictError, 422: InvalidRequestError, 429: RateLimitedError,
                                     503: UnavailableError}
"""Status -> the class raised for it; any other error status raises ApiError."""


def api_error(status_code: int, headers: Mapping[str, str], content: bytes, *, method: str = "",
              url: str = "") -> ApiError:
    """The exception for an error answer (its status, headers and body bytes)."""
    body = _json(content)
    if isinstance(body, dict) and "detail" in body:
        detail: Any = body["detail"]
    elif isinstance(body, dict) and isinstance(body.get("error"), dict):
        detail = body["error"]
    else:
        detail = content.decode("utf-8", "replace").strip() or f"HTTP {status_code}"
    kind = ERRORS.get(status_code, ApiError)
    kw: dict[str, Any] = {"method": method, "url": url, "body": body, "headers": headers}
    lowered = {k.lower(): v for k, v in headers.items()}
    if kind is RateLimitedError:
        fields = body if isinstance(body, dict) else {}
        limit = fields.get("limit", detail.get("param") if isinstance(detail, dict) else None)
        value = fields.get("value")
        return RateLimitedError(status_code, detail, retry_after_s=parse_retry_after(lowered.get("retry-after")),
                                limit=_text(limit), value=value if isinstance(value, int) else None, **kw)
    if kind is UnavailableError:
        return UnavailableError(status_code, detail, retry_after_s=parse_retry_after(lowered.get("retry-after")),
                                **kw)
    return kind(status_code, detail, **kw)


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """A Retry-After header in seconds: delay-seconds ('5') or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    text = value.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _json(content: bytes) -> Any:
    try:
        return json.loads(content) if content else None
    except ValueError:
        return None


def _loc(item: dict[str, Any]) -> str:
    return ".".join(str(p) for p in item.get("loc", []))


def _text(value: Any) -> str | None:
    return None if value is None else str(value)
