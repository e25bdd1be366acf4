"""The client reads both error bodies the API sends, built here by the server's own code: the API's
``{"detail": ...}`` (api/main.py's handlers, FastAPI's 401) and the OpenAI routes' ``{"error": {...}}``."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from starlette.responses import Response

from api.auth import UNAUTHORIZED
from api.main import _overloaded, _quota_exceeded
from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.client import (
    ApiError,
    Client,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    RateLimitedError,
    UnauthorizedError,
    UnavailableError,
)
from omni_jobs.client.errors import api_error, parse_retry_after
from omni_jobs.core.errors import Overloaded, QuotaExceeded
from tests.own_loop import run_in_own_loop

URL = "http://api.test/v1/jobs"


def from_response(response: Response, method: str = "POST") -> ApiError:
    return api_error(response.status_code, dict(response.headers), bytes(response.body), method=method, url=URL)


def test_a_quota_refusal_is_a_rate_limited_error_with_the_limit_its_value_and_retry_after() -> None:
    error = from_response(_quota_exceeded(Request({"type": "http"}), QuotaExceeded("acme", "jobs_per_minute", 2, 41.3)))
    assert isinstance(error, RateLimitedError) and error.status_code == 429
    assert (error.limit, error.value, error.retry_after_s) == ("jobs_per_minute", 2, 41.0)
    assert error.message.startswith("tenant 'acme' reached its limit jobs_per_minute=2")
    assert str(error) == f"POST {URL} -> 429: {error.message}"


def test_the_openai_routes_429_gives_the_limit_from_param_and_names_the_code() -> None:
    exc = OpenAIError(429, "tenant 'acme' reached its limit max_active=1", code="rate_limit_exceeded",
                      type_="requests", param="max_active", retry_after_s=3.4)
    error = api_error(exc.status, exc.headers(), json.dumps(exc.body()).encode(), method="POST", url=URL)
    assert isinstance(error, RateLimitedError)
    assert (error.limit, error.value, error.retry_after_s) == ("max_active", None, 3.0)
    assert (error.code, error.type, error.param) == ("rate_limit_exceeded", "requests", "max_active")
    assert str(error) == f"POST {URL} -> 429: tenant 'acme' reached its limit max_active=1 [rate_limit_exceeded]"


def test_an_openai_400_is_an_invalid_request_naming_its_param() -> None:
    exc = OpenAIError(400, "messages: the last user message holds no text", param="messages")
    error = api_error(400, exc.headers(), json.dumps(exc.body()).encode())
    assert isinstance(error, InvalidRequestError)
    assert error.fields == {"messages": "messages: the last user message holds no text"}
    assert error.code is None and error.message == "messages: the last user message holds no text"


def test_a_missing_key_is_unauthorized_with_the_servers_message() -> None:
    refusal = HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})  # as api/auth.py raises it
    error = from_response(run_in_own_loop(http_exception_handler(Request({"type": "http"}), refusal)), method="GET")
    assert isinstance(error, UnauthorizedError) and error.message == UNAUTHORIZED
    assert error.headers["www-authenticate"] == "Bearer"


def test_field_errors_conflicts_missing_jobs_and_overload() -> None:
    detail = [{"loc": ["body", "input", "prompt"], "msg": "Input should be a valid string", "type": "string_type"},
              {"loc": ["body", "webhook"], "msg": "not an http(s) URL", "type": "value_error"}]
    invalid = api_error(422, {}, json.dumps({"detail": detail}).encode())
    assert isinstance(invalid, InvalidRequestError)
    assert invalid.fields == {"body.input.prompt": "Input should be a valid string", "body.webhook": "not an http(s) URL"}
    assert invalid.message == "body.input.prompt: Input should be a valid string; body.webhook: not an http(s) URL"
    gone = api_error(404, {}, b'{"detail": "no job \'job_x\'"}')
    assert isinstance(gone, NotFoundError) and gone.message == "no job 'job_x'"
    assert isinstance(api_error(409, {}, b'{"detail": "job already succeeded"}'), ConflictError)
    full = from_response(_overloaded(Request({"type": "http"}), Overloaded("dit", 50, 50, 7)))
    assert isinstance(full, UnavailableError) and full.retry_after_s == 7.0 and "queue 'dit' is full" in full.message


def test_a_body_that_is_not_json_is_the_detail_as_text() -> None:
    error = api_error(502, {"content-type": "text/html"}, b"<h1>Bad Gateway</h1>\n")
    assert type(error) is ApiError and error.detail == "<h1>Bad Gateway</h1>" and error.body is None
    assert api_error(500, {}, b"").message == "HTTP 500"


def test_retry_after_in_seconds_or_as_a_date() -> None:
    assert parse_retry_after("5") == 5.0 and parse_retry_after(" 2.5 ") == 2.5
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:30 GMT", now=1445412480.0) == 30.0  # 07:28:00 GMT
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:30 GMT", now=1445412600.0) == 0.0  # already past
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None and parse_retry_after("nan") is None


def test_the_client_raises_them_from_a_real_answer() -> None:
    def respond(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, headers={"Retry-After": "12"},
                              json={"detail": "tenant 't' reached its limit max_active=1", "limit": "max_active",
                                    "value": 1})

    transport = httpx.MockTransport(respond)
    with Client("http://api.test", api_key="ok_1", transport=transport) as omni, pytest.raises(RateLimitedError) as refused:
        omni.submit("text-to-image", prompt="x")
    assert (refused.value.limit, refused.value.value, refused.value.retry_after_s) == ("max_active", 1, 12.0)
    assert str(refused.value).startswith("POST http://api.test/v1/jobs -> 429: tenant 't'")
