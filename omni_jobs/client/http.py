"""The HTTP client's implementation; import it from ``omni_jobs.client``."""

from __future__ import annotations

import asyncio
import json
import mimetypes
import os
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Self

import httpx
from pydantic import BaseModel, ConfigDict, Field

from omni_jobs.text_stream import DeltaReader

DEFAULT_API_URL = "http://127.0.0.1:8000"
FINAL_STATUSES = frozenset({"succeeded", "failed", "canceled"})
FINAL_EVENTS = frozenset({"job.succeeded", "job.failed", "job.canceled"})
PipelineList = list[dict[str, Any]]
"""GET /v1/pipelines: each pipeline's name, description, inputs, stages and outputs."""
_EXTENSIONS = {"image/png": ".png", "application/json": ".json", "audio/wav": ".wav", "audio/x-wav": ".wav",
               "video/mp4": ".mp4", "image/jpeg": ".jpg",
               "application/vnd.safetensors": ".safetensors", "application/octet-stream": ".bin"}


# --- errors ---
class ApiError(Exception):
    """The API answered with an error status; ``detail`` is its JSON detail (or the text)."""

    def __init__(self, status_code: int, detail: Any, *, method: str = "", url: str = "") -> None:
        self.status_code = status_code
        self.detail = detail
        super().__init__(f"{method} {url} -> {status_code}: {self.describe(detail)}".strip())

    @staticmethod
    def describe(detail: Any) -> str:
        if isinstance(detail, list):  # 422: [{"loc": [...], "msg": ...}]
            return "; ".join(
                f"{'.'.join(str(p) for p in d.get('loc', []))}: {d.get('msg')}" if isinstance(d, dict) else str(d)
                for d in detail
            )
        return str(detail)


class InvalidRequestError(ApiError):
    """422: the request named a bad field; ``fields`` maps 'body.input.prompt' -> message."""

    @property
    def fields(self) -> dict[str, str]:
        if not isinstance(self.detail, list):
            return {}
        return {".".join(str(p) for p in d.get("loc", [])): str(d.get("msg")) for d in self.detail
                if isinstance(d, dict)}


class NotFoundError(ApiError):
    """404: no such job (or output)."""


class ConflictError(ApiError):
    """409: e.g. canceling a job that already ended, or an Idempotency-Key reused with another body."""


class UnavailableError(ApiError):
    """503: overloaded or a backing service is down; ``retry_after_s`` says when to try again."""

    def __init__(self, status_code: int, detail: Any, *, retry_after_s: float | None = None, **kw: Any) -> None:
        super().__init__(status_code, detail, **kw)
        self.retry_after_s = retry_after_s


_ERRORS: dict[int, type[ApiError]] = {404: NotFoundError, 409: ConflictError, 422: InvalidRequestError,
                                      503: UnavailableError}


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text
    kind = _ERRORS.get(response.status_code, ApiError)
    kw: dict[str, Any] = {"method": response.request.method, "url": str(response.request.url)}
    if kind is UnavailableError:
        retry_after = response.headers.get("retry-after", "")
        kw["retry_after_s"] = float(retry_after) if retry_after.isdigit() else None
    raise kind(response.status_code, detail, **kw)


# --- the shapes the API returns (extra fields are kept: the server may add some) ---
class _Shape(BaseModel):
    model_config = ConfigDict(extra="allow")


class Progress(_Shape):
    stage: str
    step: int
    total: int
    unit: str = "steps"


class StageInfo(_Shape):
    id: str
    engine: str
    queue: str
    status: str
    queued_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    duration_s: float | None = None
    wait_s: float | None = None
    worker: str | None = None
    attempts: int = 0
    metrics: dict[str, float] = Field(default_factory=dict)


class OutputInfo(_Shape):
    name: str
    type: str
    media_type: str
    size: int
    url: str
    width: int | None = None
    height: int | None = None
    duration_s: float | None = None
    sample_rate: int | None = None
    frames: int | None = None
    fps: float | None = None
    text: str | None = None


class WebhookDeliveryInfo(_Shape):
    id: str
    event: str
    attempt: int
    at: float
    status_code: int | None = None
    error: str | None = None
    duration_s: float | None = None


class WebhookInfo(_Shape):
    url: str
    events: list[str]
    deliveries: list[WebhookDeliveryInfo] = Field(default_factory=list)


class JobErrorInfo(_Shape):
    stage: str | None = None
    type: str
    message: str


class JobInfo(_Shape):
    """A job as the API shows it (GET, lists, SSE final events, webhooks)."""

    id: str
    pipeline: str
    status: str
    input: dict[str, Any] = Field(default_factory=dict)
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    stage: str | None = None
    progress: Progress | None = None
    queue_position: int | None = None
    stages: list[StageInfo] = Field(default_factory=list)
    outputs: list[OutputInfo] = Field(default_factory=list)
    error: JobErrorInfo | None = None
    created_at: float
    started_at: float | None = None
    completed_at: float | None = None
    metrics: dict[str, float | None] = Field(default_factory=dict)
    webhook: WebhookInfo | None = None
    urls: dict[str, str] = Field(default_factory=dict)

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES

    def output(self, name: str) -> OutputInfo | None:
        return next((o for o in self.outputs if o.name == name), None)


class JobPage(_Shape):
    data: list[JobInfo]
    next_cursor: str | None = None


class JobEventInfo(_Shape):
    """One Server-Sent Event of a job: ``type`` (stage.progress, job.succeeded, ...), ``data``, and on
    the final event the finished ``job``."""

    id: str = ""
    job_id: str
    type: str
    at: float
    data: dict[str, Any] = Field(default_factory=dict)
    job: JobInfo | None = None

    @property
    def is_final(self) -> bool:
        return self.type in FINAL_EVENTS


# --- helpers shared by both clients ---
def _job_body(pipeline: str, input: Mapping[str, Any] | None, prompt: str | None, params: Mapping[str, Any] | None,
              webhook: str | None, webhook_events_filter: Iterable[str] | None) -> dict[str, Any]:
    body_input = dict(input or {})
    if prompt is not None:
        body_input["prompt"] = prompt
    body: dict[str, Any] = {"pipeline": pipeline, "input": body_input}
    if params:
        body["params"] = dict(params)
    if webhook is not None:
        body["webhook"] = webhook
    if webhook_events_filter is not None:
        body["webhook_events_filter"] = list(webhook_events_filter)
    return body


FileInput = bytes | str | Path
"""A file input for ``submit(files=...)``: its bytes, or the path of a local file."""


def _submit_request(body: dict[str, Any], files: Mapping[str, FileInput] | None) -> tuple[str, dict[str, Any]]:
    """The path and httpx arguments of a submit: JSON, or a multipart form when there are files
    (each file a part named ``input.<field>``, as ``curl -F input.image=@photo.png`` sends it)."""
    if not files:
        return "/v1/jobs", {"json": body}
    form = {key: value if isinstance(value, str) else json.dumps(value) for key, value in body.items()}
    parts: dict[str, tuple[str, bytes]] = {}
    for name, source in files.items():
        if isinstance(source, bytes):
            parts[f"input.{name}"] = (name, source)
        else:
            path = Path(source)
            parts[f"input.{name}"] = (path.name, path.read_bytes())
    return "/v1/jobs/multipart", {"data": form, "files": parts}


def _submit_headers(wait: float | None, idempotency_key: str | None, cancel_after: str | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if wait is not None and wait > 0:
        headers["Prefer"] = f"wait={int(wait) if float(wait).is_integer() else wait}"
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    if cancel_after is not None:
        headers["Cancel-After"] = cancel_after
    return headers


def output_filename(output: OutputInfo) -> str:
    ext = _EXTENSIONS.get(output.media_type) or mimetypes.guess_extension(output.media_type) or ""
    return f"{output.name}{ext}"


class _SseParser:
    """Lines of a text/event-stream -> (id, event, data) messages (comments and retry: skipped)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.event: str | None = None
        self.data: list[str] = []
        self.id: str | None = None

    def feed(self, line: str) -> tuple[str | None, str | None, str] | None:
        if line == "":
            message = (self.id, self.event, "\n".join(self.data)) if self.data else None
            self._reset()
            return message
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self.data.append(value)
        elif name == "event":
            self.event = value
        elif name == "id":
            self.id = value
        return None


def _event(data: str) -> JobEventInfo:
    return JobEventInfo.model_validate_json(data)


def _headers(api_key: str | None, extra: Mapping[str, str] | None) -> dict[str, str]:
    headers = {"user-agent": "omni-jobs-client/0.1", **(extra or {})}
    api_key = api_key if api_key is not None else os.environ.get("OMNI_API_KEY")  # as the CLI: the key from env
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


# --- sync ---
class Client:
    """Blocking client. ``Client(api_url, api_key=None, timeout=30)``; use as a context manager."""

    def __init__(self, api_url: str = DEFAULT_API_URL, *, api_key: str | None = None, timeout: float = 30.0,
                 headers: Mapping[str, str] | None = None, transport: httpx.BaseTransport | None = None) -> None:
        self.api_url = api_url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.Client(base_url=self.api_url, timeout=timeout, headers=_headers(api_key, headers),
                                  transport=transport)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        response = self._http.request(method, path, **kw)
        _raise_for(response)
        return response

    def submit(self, pipeline: str, input: Mapping[str, Any] | None = None, *, prompt: str | None = None,
               params: Mapping[str, Any] | None = None, webhook: str | None = None,
               webhook_events_filter: Iterable[str] | None = None, wait: float | None = None,
               idempotency_key: str | None = None, cancel_after: str | None = None,
               files: Mapping[str, FileInput] | None = None) -> JobInfo:
        """Submit a job. With ``wait`` (seconds) the call returns once the job ended or ``wait`` passed:
        the server holds the answer (``Prefer: wait``) up to its cap, then this client polls.
        ``files``: inputs sent as uploaded files (bytes or a local path), e.g. ``{"image": "photo.png"}``."""
        started = time.monotonic()
        body = _job_body(pipeline, input, prompt, params, webhook, webhook_events_filter)
        path, content = _submit_request(body, files)
        timeout = self.timeout + (wait or 0)
        job = JobInfo.model_validate(self._request(
            "POST", path, **content, headers=_submit_headers(wait, idempotency_key, cancel_after),
            timeout=timeout).json())
        if wait is not None and not job.is_final:
            remaining = wait - (time.monotonic() - started)
            if remaining > 0:
                job = self.wait(job.id, timeout=remaining, raise_on_timeout=False)
        return job

    def get(self, job_id: str) -> JobInfo:
        return JobInfo.model_validate(self._request("GET", f"/v1/jobs/{job_id}").json())

    def list(self, *, limit: int = 20, cursor: str | None = None, status: str | None = None) -> JobPage:
        query: dict[str, Any] = {"limit": limit}
        if cursor:
            query["cursor"] = cursor
        if status:
            query["status"] = status
        return JobPage.model_validate(self._request("GET", "/v1/jobs", params=query).json())

    def iter_jobs(self, *, status: str | None = None, page_size: int = 50) -> Iterator[JobInfo]:
        """Every job, newest first, across pages."""
        cursor: str | None = None
        while True:
            page = self.list(limit=page_size, cursor=cursor, status=status)
            yield from page.data
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    def cancel(self, job_id: str) -> JobInfo:
        return JobInfo.model_validate(self._request("POST", f"/v1/jobs/{job_id}/cancel").json())

    def pipelines(self) -> PipelineList:
        data: Any = self._request("GET", "/v1/pipelines").json()
        return list(data["data"] if isinstance(data, dict) and "data" in data else data)

    def events(self, job_id: str, *, last_event_id: str | None = None, reconnect: int = 5) -> Iterator[JobEventInfo]:
        """The job's events (Server-Sent Events) until it ends; resumes after a dropped connection."""
        failures = 0
        while True:
            headers = {"accept": "text/event-stream"}
            if last_event_id:
                headers["last-event-id"] = last_event_id
            try:
                with self._http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers,
                                       timeout=httpx.Timeout(self.timeout, read=60.0)) as response:
                    if not response.is_success:
                        response.read()
                        _raise_for(response)
                    parser = _SseParser()
                    for line in response.iter_lines():
                        message = parser.feed(line)
                        if message is None:
                            continue
                        event = _event(message[2])
                        last_event_id = message[0] or last_event_id
                        failures = 0
                        yield event
                        if event.is_final:
                            return
            except httpx.TransportError:
                failures += 1
                if failures > reconnect:
                    raise
                time.sleep(min(2.0, 0.2 * 2**failures))
                continue
            if self.get(job_id).is_final:  # closed without a final event: it ended before we resumed
                return

    def stream_text(self, job_id: str, *, stage: str | None = None, output: str = "text",
                    last_event_id: str | None = None) -> Iterator[str]:
        """An AR stage's text as it is generated (its ``output.delta`` events), piece by piece, until
        the job ends; joined, the pieces are the stage's text output. ``stage=None``: the first
        stage that streams text. It ends quietly when the job ends, however it ended: ``get`` says."""
        reader = DeltaReader(stage, output)
        for event in self.events(job_id, last_event_id=last_event_id):
            piece = reader.feed(event.data) if event.type == "output.delta" else ""
            if piece:
                yield piece

    def wait(self, job_id: str, *, timeout: float = 600.0, poll_s: float = 0.25,
             raise_on_timeout: bool = True) -> JobInfo:
        """Poll until the job ends; TimeoutError (or the job as it is) after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        delay = poll_s
        while True:
            job = self.get(job_id)
            if job.is_final:
                return job
            if time.monotonic() >= deadline:
                if raise_on_timeout:
                    raise TimeoutError(f"job {job_id} still {job.status} after {timeout:g}s")
                return job
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, 2.0)

    def download(self, output: OutputInfo, path: str | Path) -> Path:
        """Write one output to ``path`` (a file, or a directory to put ``<name>.<ext>`` in)."""
        target = Path(path)
        if target.is_dir():
            target = target / output_filename(output)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Presigned store URLs are fetched without this client's headers (no API key to a third party).
        own = output.url.startswith(self.api_url)
        with (self._http.stream("GET", output.url) if own else httpx.stream("GET", output.url, timeout=self.timeout)
              ) as response:
            if not response.is_success:
                response.read()
                _raise_for(response)
            with target.open("wb") as f:
                for chunk in response.iter_bytes():
                    f.write(chunk)
        return target

    def download_outputs(self, job: JobInfo | str, directory: str | Path) -> dict[str, Path]:
        """Every output of a finished job into ``directory``: {output name: file path}."""
        info = self.get(job) if isinstance(job, str) else job
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        return {o.name: self.download(o, folder / output_filename(o)) for o in info.outputs}


# --- async ---
class AsyncClient:
    """The same API with ``await``: ``async with AsyncClient(url) as omni: job = await omni.submit(...)``."""

    def __init__(self, api_url: str = DEFAULT_API_URL, *, api_key: str | None = None, timeout: float = 30.0,
                 headers: Mapping[str, str] | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.api_url = api_url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.AsyncClient(base_url=self.api_url, timeout=timeout, headers=_headers(api_key, headers),
                                       transport=transport)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        response = await self._http.request(method, path, **kw)
        _raise_for(response)
        return response

    async def submit(self, pipeline: str, input: Mapping[str, Any] | None = None, *, prompt: str | None = None,
                     params: Mapping[str, Any] | None = None, webhook: str | None = None,
                     webhook_events_filter: Iterable[str] | None = None, wait: float | None = None,
                     idempotency_key: str | None = None, cancel_after: str | None = None,
                     files: Mapping[str, FileInput] | None = None) -> JobInfo:
        started = time.monotonic()
        body = _job_body(pipeline, input, prompt, params, webhook, webhook_events_filter)
        path, content = _submit_request(body, files)
        response = await self._request("POST", path, **content,
                                       headers=_submit_headers(wait, idempotency_key, cancel_after),
                                       timeout=self.timeout + (wait or 0))
        job = JobInfo.model_validate(response.json())
        if wait is not None and not job.is_final:
            remaining = wait - (time.monotonic() - started)
            if remaining > 0:
                job = await self.wait(job.id, timeout=remaining, raise_on_timeout=False)
        return job

    async def get(self, job_id: str) -> JobInfo:
        return JobInfo.model_validate((await self._request("GET", f"/v1/jobs/{job_id}")).json())

    async def list(self, *, limit: int = 20, cursor: str | None = None, status: str | None = None) -> JobPage:
        query: dict[str, Any] = {"limit": limit}
        if cursor:
            query["cursor"] = cursor
        if status:
            query["status"] = status
        return JobPage.model_validate((await self._request("GET", "/v1/jobs", params=query)).json())

    async def iter_jobs(self, *, status: str | None = None, page_size: int = 50) -> AsyncIterator[JobInfo]:
        cursor: str | None = None
        while True:
            page = await self.list(limit=page_size, cursor=cursor, status=status)
            for job in page.data:
                yield job
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    async def cancel(self, job_id: str) -> JobInfo:
        return JobInfo.model_validate((await self._request("POST", f"/v1/jobs/{job_id}/cancel")).json())

    async def pipelines(self) -> PipelineList:
        data: Any = (await self._request("GET", "/v1/pipelines")).json()
        return list(data["data"] if isinstance(data, dict) and "data" in data else data)

    async def events(self, job_id: str, *, last_event_id: str | None = None,
                     reconnect: int = 5) -> AsyncIterator[JobEventInfo]:
        failures = 0
        while True:
            headers = {"accept": "text/event-stream"}
            if last_event_id:
                headers["last-event-id"] = last_event_id
            try:
                async with self._http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers,
                                             timeout=httpx.Timeout(self.timeout, read=60.0)) as response:
                    if not response.is_success:
                        await response.aread()
                        _raise_for(response)
                    parser = _SseParser()
                    async for line in response.aiter_lines():
                        message = parser.feed(line)
                        if message is None:
                            continue
                        event = _event(message[2])
                        last_event_id = message[0] or last_event_id
                        failures = 0
                        yield event
                        if event.is_final:
                            return
            except httpx.TransportError:
                failures += 1
                if failures > reconnect:
                    raise
                await asyncio.sleep(min(2.0, 0.2 * 2**failures))
                continue
            if (await self.get(job_id)).is_final:
                return

    async def stream_text(self, job_id: str, *, stage: str | None = None, output: str = "text",
                          last_event_id: str | None = None) -> AsyncIterator[str]:
        """As ``Client.stream_text``: ``async for piece in omni.stream_text(job.id)``."""
        reader = DeltaReader(stage, output)
        async for event in self.events(job_id, last_event_id=last_event_id):
            piece = reader.feed(event.data) if event.type == "output.delta" else ""
            if piece:
                yield piece

    async def wait(self, job_id: str, *, timeout: float = 600.0, poll_s: float = 0.25,
                   raise_on_timeout: bool = True) -> JobInfo:
        deadline = time.monotonic() + timeout
        delay = poll_s
        while True:
            job = await self.get(job_id)
            if job.is_final:
                return job
            if time.monotonic() >= deadline:
                if raise_on_timeout:
                    raise TimeoutError(f"job {job_id} still {job.status} after {timeout:g}s")
                return job
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, 2.0)

    async def download(self, output: OutputInfo, path: str | Path) -> Path:
        target = Path(path)
        if target.is_dir():
            target = target / output_filename(output)
        target.parent.mkdir(parents=True, exist_ok=True)
        if output.url.startswith(self.api_url):
            response = await self._http.get(output.url)
        else:
            async with httpx.AsyncClient(timeout=self.timeout) as plain:
                response = await plain.get(output.url)
        _raise_for(response)
        target.write_bytes(response.content)
        return target

    async def download_outputs(self, job: JobInfo | str, directory: str | Path) -> dict[str, Path]:
        info = await self.get(job) if isinstance(job, str) else job
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        return {o.name: await self.download(o, folder / output_filename(o)) for o in info.outputs}
