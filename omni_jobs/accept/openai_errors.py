"""The error of the OpenAI-compatible routes, in OpenAI's shape, apart from the mappings that raise it
(omni_jobs.accept.openai_requests, openai_responses, openai_content, openai_audio), so that each of them can raise it without
importing the others."""

from __future__ import annotations

from collections.abc import Iterable

from omni_jobs.core.json_types import JsonObject


class OpenAIError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {message, type, param, code}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", job_ids: Iterable[str] = (), retry: bool | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_
        self.job_ids = list(job_ids)
        self.retry = retry

    def body(self) -> JsonObject:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """X-Omni-Job-Id (the jobs it is about), x-should-retry (OpenAI's clients obey it), Retry-After."""
        headers = {}
        if self.job_ids:
            headers["X-Omni-Job-Id"] = ",".join(self.job_ids)
        if self.retry is not None:
            headers["x-should-retry"] = "true" if self.retry else "false"
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return headers
