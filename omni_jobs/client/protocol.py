"""What the sync and async clients share: the requests they send and how they read the answers.

Sans-IO: nothing here opens a connection or sleeps. A request is a :class:`Call` (built by one
function per operation), an answer is read by one function per shape, and each loop is a small state
machine that says what to send next and how long to wait first: :class:`EventStream` (Server-Sent
Events across reconnections, with Last-Event-ID), :class:`Poll` (until a job ends),
:class:`Pages` (a list's cursor), :class:`Submission` (a submit, then the rest of its wait).
``Client`` and ``AsyncClient`` (omni_jobs/client/http.py) only carry those out, each with its I/O.
"""

from __future__ import annotations

import json
import mimetypes
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict, Unpack
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ConfigDict

from omni_jobs.client.errors import api_error
from omni_jobs.client.sse import SseParser
from omni_jobs.jobs.view import JobEventView, JobListView, JobView, OutputView
from omni_jobs.run.audio_stream import AudioChunk, AudioDeltaReader
from omni_jobs.run.text_stream import DeltaReader

DEFAULT_API_URL = "http://127.0.0.1:8000"
FINAL_STATUSES = frozenset({"succeeded", "failed", "canceled"})
FINAL_EVENTS = frozenset({"job.succeeded", "job.failed", "job.canceled"})
DEFAULT_RETRY_S = 2.0
"""How long to wait before reconnecting an event stream at the most, until the server says (``retry:``)."""
EVENTS_READ_TIMEOUT_S = 60.0
"""An event stream's read timeout: the server sends a comment every 15 s while a job is quiet."""

PipelineList = list[dict[str, Any]]
"""GET /v1/pipelines: each pipeline's name, description, inputs, stages and outputs."""
FileInput = bytes | str | Path
"""A file input for ``submit(files=...)``: its bytes, or the path of a local file."""

_EXTENSIONS = {"image/png": ".png", "application/json": ".json", "audio/wav": ".wav", "audio/x-wav": ".wav",
               "video/mp4": ".mp4", "image/jpeg": ".jpg",
               "application/vnd.safetensors": ".safetensors", "application/octet-stream": ".bin"}
AudioFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
AUDIO_EXTENSIONS: dict[str, str] = {"mp3": ".mp3", "opus": ".opus", "aac": ".aac", "flac": ".flac", "wav": ".wav",
                                    "pcm": ".pcm"}
"""The formats the API converts an audio output to (``?format=``, omni_jobs.media.audio_formats, not imported here: it
needs numpy) and the extension of each one's file."""


# --- requests ---
@dataclass(frozen=True)
class Call:
    """One HTTP request to make. ``url`` is a path under the API (sent with the client's headers,
    the API key among them) unless ``anonymous``: then it is a full URL, sent with no header of the
    client's (a presigned store URL: the API key is never sent to a third party)."""

    method: str
    url: str
    params: dict[str, str | int] | None = None
    json: Any = None
    data: dict[str, str] | None = None
    files: dict[str, tuple[str, bytes]] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float | httpx.Timeout | None = None
    """None: the client's timeout."""
    anonymous: bool = False

    def build(self, http: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        """The httpx request, with ``http``'s base URL, headers and timeout unless anonymous."""
        if self.anonymous:
            timeout = httpx.Timeout(self.timeout if self.timeout is not None else http.timeout)
            return httpx.Request(self.method, self.url, params=self.params, headers=self.headers,
                                 extensions={"timeout": timeout.as_dict()})
        return http.build_request(self.method, self.url, params=self.params, json=self.json, data=self.data,
                                  files=self.files, headers=self.headers,
                                  timeout=self.timeout if self.timeout is not None else httpx.USE_CLIENT_DEFAULT)


def client_headers(api_key: str | None, extra: Mapping[str, str] | None) -> dict[str, str]:
    """Every request's headers: the user agent, ``extra``, and the API key (``api_key``, else $OMNI_API_KEY)."""
    headers = {"user-agent": "omni-jobs-client/0.1", **(extra or {})}
    api_key = api_key if api_key is not None else os.environ.get("OMNI_API_KEY")
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


def _job_path(job_id: str) -> str:
    return f"/v1/jobs/{quote(job_id, safe='')}"


def get_call(job_id: str) -> Call:
    return Call("GET", _job_path(job_id))


def cancel_call(job_id: str) -> Call:
    return Call("POST", f"{_job_path(job_id)}/cancel")


def list_call(*, limit: int = 20, cursor: str | None = None, status: str | None = None) -> Call:
    query: dict[str, str | int] = {"limit": limit}
    if cursor:
        query["cursor"] = cursor
    if status:
        query["status"] = status
    return Call("GET", "/v1/jobs", params=query)


def pipelines_call() -> Call:
    return Call("GET", "/v1/pipelines")


def download_call(output: OutputView, api_url: str, *, audio_format: AudioFormat | None = None,
                  job_id: str | None = None) -> Call:
    """GET an output: the API's own route with the client's key; any other URL (presigned) without it.

    ``audio_format``: the API converts an audio output (``?format=``), so it is the API's route, built from
    ``job_id`` when the output's URL is elsewhere (a presigned store URL knows no format)."""
    if audio_format is None:
        return Call("GET", output.url, anonymous=not _is_under(output.url, api_url))
    if job_id is not None:
        url = f"/v1/jobs/{quote(job_id, safe='')}/outputs/{quote(output.name, safe='')}"
    elif _is_under(output.url, api_url):
        url = output.url
    else:
        raise ValueError(f"audio_format needs the API's download route and output '{output.name}' is at "
                         f"{output.url.split('?')[0]}: pass job_id=, or use download_outputs(job, ..., audio_format=)")
    return Call("GET", url, params={"format": audio_format})


def format_for(output: OutputView, audio_format: AudioFormat | None) -> AudioFormat | None:
    """The format to ask for ``output``: ``audio_format`` for an audio output; the stored file for the others."""
    return audio_format if output.type == "audio" else None


def _is_under(url: str, api_url: str) -> bool:
    """Whether ``url`` is on the API (same scheme, host and port, under its path): a prefix of the
    text is not enough (http://api.example.com.evil/ starts with http://api.example.com)."""
    target, base = httpx.URL(url), httpx.URL(api_url)
    if target.is_relative_url:
        return True
    same_origin = (target.scheme, target.host, target.port) == (base.scheme, base.host, base.port)
    return same_origin and target.path.startswith(base.path.rstrip("/") + "/")


# --- answers ---
def raise_for(response: httpx.Response) -> None:
    """Raise the ApiError subclass for an error answer (its body must have been read)."""
    if not response.is_success:
        raise api_error(response.status_code, response.headers, response.content,
                        method=response.request.method, url=str(response.request.url))


def read_job(response: httpx.Response) -> JobView:
    return JobView.model_validate_json(response.content)


def read_page(response: httpx.Response) -> JobListView:
    return JobListView.model_validate_json(response.content)


def read_pipelines(response: httpx.Response) -> PipelineList:
    data: Any = response.json()
    return list(data["data"] if isinstance(data, dict) and "data" in data else data)


# --- submit ---
class SubmitOptions(TypedDict, total=False):
    """The keyword options of ``submit`` (``Client`` and ``AsyncClient``)."""

    prompt: str | None
    """Sets ``input.prompt``."""
    params: Mapping[str, Any] | None
    """Per-stage parameters, e.g. ``{"dit": {"seed": 7}}``."""
    webhook: str | None
    """An http(s) URL that receives the job, signed, as it changes."""
    webhook_events_filter: Iterable[str] | None
    """Which events send the webhook: start, progress, completed, preview."""
    wait: float | None
    """Return once the job ended or this many seconds passed (``Prefer: wait``, then polling)."""
    idempotency_key: str | None
    """A retried submit with the same key and body gets the same job."""
    cancel_after: str | None
    """The job is canceled if it has not ended by then (``Cancel-After``: seconds, e.g. '300')."""
    files: Mapping[str, FileInput] | None
    """File inputs (image, audio, video) sent as uploads (bytes or a local path), e.g. ``{"image": "photo.png"}``,
    ``{"audio": Path("speech.wav")}``; the server decodes and stores them (parts named input.<field>)."""


class Submission:
    """A submit and what follows it. With ``wait`` the server holds its answer (``Prefer: wait``) up
    to its own cap; ``left`` then says how long the client still polls for the job to end."""

    def __init__(self, pipeline: str, input: Mapping[str, Any] | None = None, *, timeout: float,
                 clock: Callable[[], float] = time.monotonic, **opts: Unpack[SubmitOptions]) -> None:
        self._clock = clock
        self.started = clock()
        self.wait = opts.get("wait")
        body = _job_body(pipeline, input, opts)
        headers = _submit_headers(self.wait, opts.get("idempotency_key"), opts.get("cancel_after"))
        timeout_s = timeout + (self.wait or 0)
        files = opts.get("files")
        if not files:
            self.call = Call("POST", "/v1/jobs", json=body, headers=headers, timeout=timeout_s)
        else:  # a multipart form: each file a part named input.<field>, as curl -F input.image=@photo.png
            form = {key: value if isinstance(value, str) else json.dumps(value) for key, value in body.items()}
            self.call = Call("POST", "/v1/jobs/multipart", data=form, files=_file_parts(files), headers=headers,
                             timeout=timeout_s)

    def left(self, job: JobView) -> float | None:
        """Seconds to keep polling for ``job`` (the submit's answer) to end; None: return it as it is."""
        if self.wait is None or job.is_final:
            return None
        remaining = self.wait - (self._clock() - self.started)
        return remaining if remaining > 0 else None


def _job_body(pipeline: str, input: Mapping[str, Any] | None, opts: SubmitOptions) -> dict[str, Any]:
    body_input = dict(input or {})
    if (prompt := opts.get("prompt")) is not None:
        body_input["prompt"] = prompt
    body: dict[str, Any] = {"pipeline": pipeline, "input": body_input}
    if params := opts.get("params"):
        body["params"] = dict(params)
    if (webhook := opts.get("webhook")) is not None:
        body["webhook"] = webhook
    if (events := opts.get("webhook_events_filter")) is not None:
        body["webhook_events_filter"] = list(events)
    return body


def _submit_headers(wait: float | None, idempotency_key: str | None, cancel_after: str | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if wait is not None and wait > 0:
        headers["Prefer"] = f"wait={int(wait) if float(wait).is_integer() else wait}"
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    if cancel_after is not None:
        headers["Cancel-After"] = cancel_after
    return headers


def _file_parts(files: Mapping[str, FileInput]) -> dict[str, tuple[str, bytes]]:
    parts: dict[str, tuple[str, bytes]] = {}
    for name, source in files.items():
        if isinstance(source, bytes):
            parts[f"input.{name}"] = (name, source)
        else:
            path = Path(source)
            parts[f"input.{name}"] = (path.name, path.read_bytes())
    return parts


# --- transcriptions (POST /v1/audio/transcriptions, /v1/audio/translations) ---
JsonFormat = Literal["json", "verbose_json"]
TextFormat = Literal["text", "srt", "vtt"]
TRANSCRIBE_TIMEOUT_S = 600.0
"""How long a transcription's answer is waited for: the API holds it until the job ends (OMNI_OPENAI_WAIT_S)."""


class TranscribeOptions(TypedDict, total=False):
    """The keyword options of ``transcribe`` besides ``response_format``."""

    model: str
    """A speech-to-text pipeline (default ``speech-to-text``; OpenAI's ``whisper-1`` runs it too; another name is 404)."""
    language: str | None
    """The spoken language, ISO 639-1 ('en'); detected when None."""
    prompt: str | None
    """Text that came before the clip (names, spellings)."""
    temperature: float | None
    """Sampling temperature; 0 is greedy (the pipeline's default when None)."""
    translate: bool
    """English text whatever the spoken language (``/v1/audio/translations``)."""
    timeout: float
    """Seconds to wait for the answer (default 600)."""


class TranscriptionSegmentView(BaseModel):
    """One timed segment of a verbose transcription."""

    model_config = ConfigDict(extra="allow")

    id: int
    start: float
    end: float
    text: str
    seek: int = 0
    tokens: list[int] = []
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


class TranscriptionView(BaseModel):
    """A transcription as json (``text``, ``usage``) or verbose_json (also ``task``, ``language``,
    ``duration``, ``segments``); ``job_id`` is the job that made it (the X-Omni-Job-Id header)."""

    model_config = ConfigDict(extra="allow")

    text: str
    task: str | None = None
    language: str | None = None
    duration: float | None = None
    segments: list[TranscriptionSegmentView] = []
    usage: dict[str, Any] | None = None
    job_id: str | None = None


def transcription_call(file: FileInput, response_format: str, opts: TranscribeOptions) -> Call:
    """The multipart form the OpenAI client sends: ``file``, ``model``, and the options given."""
    path = "/v1/audio/translations" if opts.get("translate") else "/v1/audio/transcriptions"
    form = {"model": opts.get("model") or "speech-to-text", "response_format": response_format}
    for name in ("language", "prompt", "temperature"):
        value = opts.get(name)
        if value is not None:
            form[name] = str(value)
    if isinstance(file, bytes):
        part = ("audio", file)
    else:
        source = Path(file)
        part = (source.name, source.read_bytes())
    return Call("POST", path, data=form, files={"file": part}, timeout=opts.get("timeout", TRANSCRIBE_TIMEOUT_S))


def read_transcription(response: httpx.Response, response_format: str) -> TranscriptionView | str:
    """A json or verbose_json answer as a TranscriptionView; text, srt and vtt as their text."""
    if response_format not in ("json", "verbose_json"):
        return response.text
    view = TranscriptionView.model_validate_json(response.content)
    view.job_id = response.headers.get("x-omni-job-id")
    return view


# --- loops ---
class Poll:
    """Polling one job until it ends: after each GET, how long to sleep (growing from ``poll_s`` by
    half each time, to 2 s at the most, and never past the deadline), or to stop."""

    def __init__(self, job_id: str, *, timeout: float, poll_s: float = 0.25, raise_on_timeout: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.call = get_call(job_id)
        self.timeout = timeout
        self.raise_on_timeout = raise_on_timeout
        self._clock = clock
        self._deadline = clock() + timeout
        self._delay = poll_s

    def after(self, job: JobView) -> float | None:
        """Seconds to sleep before the next GET; None: return ``job`` (it ended, or the time is up).
        TimeoutError when the time is up and ``raise_on_timeout``."""
        if job.is_final:
            return None
        now = self._clock()
        if now >= self._deadline:
            if self.raise_on_timeout:
                raise TimeoutError(f"job {job.id} still {job.status.value} after {self.timeout:g}s")
            return None
        delay = min(self._delay, self._deadline - now)
        self._delay = min(self._delay * 1.5, 2.0)
        return delay


class Pages:
    """Every job of a list (GET /v1/jobs, newest first), page after page by its cursor."""

    def __init__(self, *, status: str | None = None, page_size: int = 50) -> None:
        self.status = status
        self.page_size = page_size
        self.cursor: str | None = None
        self.done = False

    def next_call(self) -> Call | None:
        """The next page's request; None after the last page."""
        return None if self.done else list_call(limit=self.page_size, cursor=self.cursor, status=self.status)

    def read(self, response: httpx.Response) -> list[JobView]:
        page = read_page(response)
        self.cursor = page.next_cursor
        self.done = not page.next_cursor
        return page.data


class EventStream:
    """Following one job's events (GET /v1/jobs/{id}/events) across connections until it ends.

    ``next_call`` is the request to make (None once the final event was read), after ``pause_s``
    seconds; ``feed`` reads each line of the answer; ``dropped`` or ``closed`` is told how a connection
    ended. Every reconnection sends Last-Event-ID, the id of the last event handed out, so the server
    resumes right after it: no event is lost or handed out twice. A failed connection is retried
    ``reconnect`` times in a row (each event read resets the count), after 0.4 s, 0.8 s, ... up to the
    server's ``retry`` (2 s until it says)."""

    def __init__(self, job_id: str, *, last_event_id: str | None = None, reconnect: int = 5,
                 timeout: float = 30.0, read_timeout: float = EVENTS_READ_TIMEOUT_S) -> None:
        self.job_id = job_id
        self.last_event_id = last_event_id or ""
        self.reconnect = reconnect
        self.failures = 0
        self.retry_s = DEFAULT_RETRY_S
        self.pause_s = 0.0
        self.done = False
        self._timeout = httpx.Timeout(timeout, read=read_timeout)
        self._parser = SseParser(self.last_event_id)

    def next_call(self) -> Call | None:
        """The (re)connection's request; None once the stream ended."""
        if self.done:
            return None
        self._parser = SseParser(self.last_event_id)  # a message cut by a dropped connection is dropped with it
        headers = {"accept": "text/event-stream"}
        if self.last_event_id:
            headers["last-event-id"] = self.last_event_id
        return Call("GET", f"{_job_path(self.job_id)}/events", headers=headers, timeout=self._timeout)

    def feed(self, line: str) -> JobEventView | None:
        """Read one line; the event it completes, if it completes one (after which ``done`` may be set)."""
        message = self._parser.feed(line)
        if self._parser.retry_ms is not None:
            self.retry_s = self._parser.retry_ms / 1000
        if message is None:
            return None
        event = JobEventView.model_validate_json(message.data)
        self.last_event_id = message.id or event.id or self.last_event_id
        self.failures = 0
        self.done = event.is_final
        return event

    def dropped(self, error: Exception) -> None:
        """The connection failed (refused, reset, timed out): reconnect after ``pause_s``, or raise
        ``error`` once ``reconnect`` attempts in a row have failed."""
        self.failures += 1
        if self.failures > self.reconnect:
            raise error
        self.pause_s = min(self.retry_s, 0.2 * 2**self.failures)

    def closed(self, job: JobView) -> None:
        """The server closed the stream before the final event; ``job`` is the job now. If it ended,
        the stream ends too (it ended while no connection was open); else reconnect after ``retry``."""
        self.done = job.is_final
        self.pause_s = self.retry_s


class TextPieces:
    """An AR stage's text out of a job's events: each ``output.delta``'s new text (see DeltaReader)."""

    def __init__(self, stage: str | None = None, output: str = "text") -> None:
        self._reader = DeltaReader(stage, output)

    def feed(self, event: JobEventView) -> str:
        return self._reader.feed(event.data) if event.type == "output.delta" else ""


class AudioPieces:
    """Streamed speech out of a job's events: each ``output.delta``'s new audio (see AudioDeltaReader: a stage run
    again starts its audio over, and only the samples beyond those handed out are new)."""

    def __init__(self, stage: str | None = None, output: str = "audio") -> None:
        self._reader = AudioDeltaReader(stage, output)

    def feed(self, event: JobEventView) -> AudioChunk | None:
        return self._reader.feed(event.data) if event.type == "output.delta" else None


# --- downloads ---
def output_filename(output: OutputView, audio_format: AudioFormat | None = None) -> str:
    """``<name>.<ext>``, the extension from the output's media type (image.png, text.json, ...), or from
    ``audio_format`` for an audio output (audio.mp3)."""
    if (fmt := format_for(output, audio_format)) is not None:
        return f"{output.name}{AUDIO_EXTENSIONS[fmt]}"
    ext = _EXTENSIONS.get(output.media_type) or mimetypes.guess_extension(output.media_type) or ""
    return f"{output.name}{ext}"


def download_target(output: OutputView, path: str | Path, audio_format: AudioFormat | None = None) -> Path:
    """Where ``download`` writes: ``path``, or ``path/<name>.<ext>`` when it is a directory (parents made)."""
    target = Path(path)
    if target.is_dir():
        target = target / output_filename(output, audio_format)
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def output_targets(job: JobView, directory: str | Path,
                   audio_format: AudioFormat | None = None) -> list[tuple[OutputView, Path]]:
    """Each output of ``job`` and its file in ``directory`` (made if missing)."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    return [(o, folder / output_filename(o, audio_format)) for o in job.outputs]
