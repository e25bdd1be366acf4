"""The two clients, sync and async. They only do I/O: what to send, how to read the answers and
when to retry or stop are omni_jobs/client/protocol.py's, shared by both. Import from ``omni_jobs.client``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, Self, Unpack, overload

import httpx

from omni_jobs.client.protocol import (
    DEFAULT_API_URL,
    AudioFormat,
    AudioPieces,
    Call,
    EventStream,
    FileInput,
    JsonFormat,
    Pages,
    PipelineList,
    Poll,
    Submission,
    SubmitOptions,
    TextFormat,
    TextPieces,
    TranscribeOptions,
    TranscriptionView,
    cancel_call,
    client_headers,
    download_call,
    download_target,
    format_for,
    get_call,
    list_call,
    output_targets,
    pipelines_call,
    raise_for,
    read_job,
    read_page,
    read_pipelines,
    read_transcription,
    transcription_call,
)
from omni_jobs.jobs.view import JobEventView, JobListView, JobView, OutputView
from omni_jobs.run.audio_stream import AudioChunk


class Client:
    """Blocking client. ``Client(api_url, api_key=None, timeout=30)``; use as a context manager.
    ``api_key`` defaults to $OMNI_API_KEY."""

    def __init__(self, api_url: str = DEFAULT_API_URL, *, api_key: str | None = None, timeout: float = 30.0,
                 headers: Mapping[str, str] | None = None, transport: httpx.BaseTransport | None = None) -> None:
        self.api_url = api_url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.Client(base_url=self.api_url, timeout=timeout, headers=client_headers(api_key, headers),
                                  transport=transport)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: Call) -> httpx.Response:
        response = self._http.send(call.build(self._http))
        raise_for(response)
        return response

    @contextmanager
    def _open(self, call: Call) -> Iterator[httpx.Response]:
        """The answer to ``call``, streamed; an error status raises (its body read first)."""
        response = self._http.send(call.build(self._http), stream=True)
        try:
            if not response.is_success:
                response.read()
                raise_for(response)
            yield response
        finally:
            response.close()

    def submit(self, pipeline: str, input: Mapping[str, Any] | None = None,
               **options: Unpack[SubmitOptions]) -> JobView:
        """Submit a job: ``input`` (or ``prompt=``), and the options of ``SubmitOptions``: ``params``,
        ``webhook``, ``webhook_events_filter``, ``wait`` (seconds: return once the job ended or they
        passed), ``idempotency_key``, ``cancel_after``, ``files`` (inputs uploaded as files)."""
        submission = Submission(pipeline, input, timeout=self.timeout, **options)
        job = read_job(self._send(submission.call))
        left = submission.left(job)
        return job if left is None else self.wait(job.id, timeout=left, raise_on_timeout=False)

    def get(self, job_id: str) -> JobView:
        return read_job(self._send(get_call(job_id)))

    def list(self, *, limit: int = 20, cursor: str | None = None, status: str | None = None) -> JobListView:
        """One page of jobs, newest first; ``next_cursor`` gets the next (or use ``iter_jobs``)."""
        return read_page(self._send(list_call(limit=limit, cursor=cursor, status=status)))

    def iter_jobs(self, *, status: str | None = None, page_size: int = 50) -> Iterator[JobView]:
        """Every job, newest first, across pages."""
        pages = Pages(status=status, page_size=page_size)
        while (call := pages.next_call()) is not None:
            yield from pages.read(self._send(call))

    def cancel(self, job_id: str) -> JobView:
        return read_job(self._send(cancel_call(job_id)))

    def pipelines(self) -> PipelineList:
        return read_pipelines(self._send(pipelines_call()))

    def events(self, job_id: str, *, last_event_id: str | None = None, reconnect: int = 5) -> Iterator[JobEventView]:
        """The job's events (Server-Sent Events) until it ends; resumes after a dropped connection."""
        stream = EventStream(job_id, last_event_id=last_event_id, reconnect=reconnect, timeout=self.timeout)
        while (call := stream.next_call()) is not None:
            time.sleep(stream.pause_s)
            try:
                with self._open(call) as response:
                    for line in response.iter_lines():
                        if (event := stream.feed(line)) is not None:
                            yield event
                        if stream.done:
                            return
                stream.closed(self.get(job_id))
            except httpx.TransportError as exc:
                stream.dropped(exc)

    def stream_text(self, job_id: str, *, stage: str | None = None, output: str = "text",
                    last_event_id: str | None = None) -> Iterator[str]:
        """An AR stage's text as it is generated (its ``output.delta`` events), piece by piece, until
        the job ends; joined, the pieces are the stage's text output. ``stage=None``: the first
        stage that streams text. It ends quietly when the job ends, however it ended: ``get`` says."""
        pieces = TextPieces(stage, output)
        for event in self.events(job_id, last_event_id=last_event_id):
            if piece := pieces.feed(event):
                yield piece

    def stream_audio(self, job_id: str, *, stage: str | None = None, output: str = "audio",
                     last_event_id: str | None = None) -> Iterator[AudioChunk]:
        """Speech as it is made (a streaming stage's audio ``output.delta`` events): chunks of 16-bit mono PCM
        with their ``sample_rate`` and ``start`` sample, until the job ends; joined, they are the stored clip.
        ``stage=None``: the first stage that streams audio under ``output``. A stage run again repeats none."""
        pieces = AudioPieces(stage, output)
        for event in self.events(job_id, last_event_id=last_event_id):
            if (chunk := pieces.feed(event)) is not None:
                yield chunk

    def wait(self, job_id: str, *, timeout: float = 600.0, poll_s: float = 0.25,
             raise_on_timeout: bool = True) -> JobView:
        """Poll until the job ends; TimeoutError (or the job as it is) after ``timeout`` seconds."""
        poll = Poll(job_id, timeout=timeout, poll_s=poll_s, raise_on_timeout=raise_on_timeout)
        while True:
            job = read_job(self._send(poll.call))
            if (delay := poll.after(job)) is None:
                return job
            time.sleep(delay)

    def download(self, output: OutputView, path: str | Path, *, audio_format: AudioFormat | None = None,
                 job_id: str | None = None) -> Path:
        """Write one output to ``path`` (a file, or a directory to put ``<name>.<ext>`` in). ``audio_format``
        (mp3, opus, aac, flac, wav, pcm): an audio output converted by the API (``job_id``: whose output)."""
        target = download_target(output, path, audio_format)
        call = download_call(output, self.api_url, audio_format=audio_format, job_id=job_id)
        with self._open(call) as response, target.open("wb") as f:
            for chunk in response.iter_bytes():
                f.write(chunk)
        return target

    def download_outputs(self, job: JobView | str, directory: str | Path, *,
                         audio_format: AudioFormat | None = None) -> dict[str, Path]:
        """Every output of a finished job into ``directory``: {output name: file path}; ``audio_format``:
        its audio outputs in that format (the others as stored)."""
        info = self.get(job) if isinstance(job, str) else job
        return {o.name: self.download(o, path, audio_format=format_for(o, audio_format), job_id=info.id)
                for o, path in output_targets(info, directory, audio_format)}

    @overload
    def transcribe(self, file: FileInput, *, response_format: JsonFormat = "verbose_json",
                   **options: Unpack[TranscribeOptions]) -> TranscriptionView: ...

    @overload
    def transcribe(self, file: FileInput, *, response_format: TextFormat,
                   **options: Unpack[TranscribeOptions]) -> str: ...

    @overload
    def transcribe(self, file: FileInput, *, response_format: str,
                   **options: Unpack[TranscribeOptions]) -> TranscriptionView | str: ...

    def transcribe(self, file: FileInput, *, response_format: str = "verbose_json",
                   **options: Unpack[TranscribeOptions]) -> TranscriptionView | str:
        """Speech to text (POST /v1/audio/transcriptions, a job on a speech-to-text pipeline): ``file`` is
        the audio's bytes or a path. json and verbose_json (the default: with the language, duration and
        timed segments) come back as a TranscriptionView; text, srt and vtt as text. Options: ``model``,
        ``language``, ``prompt``, ``temperature``, ``translate`` (English text, /v1/audio/translations),
        ``timeout`` (seconds, default 600)."""
        return read_transcription(self._send(transcription_call(file, response_format, options)), response_format)


class AsyncClient:
    """The same API with ``await``: ``async with AsyncClient(url) as omni: job = await omni.submit(...)``."""

    def __init__(self, api_url: str = DEFAULT_API_URL, *, api_key: str | None = None, timeout: float = 30.0,
                 headers: Mapping[str, str] | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.api_url = api_url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.AsyncClient(base_url=self.api_url, timeout=timeout,
                                       headers=client_headers(api_key, headers), transport=transport)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: Call) -> httpx.Response:
        response = await self._http.send(call.build(self._http))
        raise_for(response)
        return response

    @asynccontextmanager
    async def _open(self, call: Call) -> AsyncIterator[httpx.Response]:
        response = await self._http.send(call.build(self._http), stream=True)
        try:
            if not response.is_success:
                await response.aread()
                raise_for(response)
            yield response
        finally:
            await response.aclose()

    async def submit(self, pipeline: str, input: Mapping[str, Any] | None = None,
                     **options: Unpack[SubmitOptions]) -> JobView:
        """As ``Client.submit``."""
        submission = Submission(pipeline, input, timeout=self.timeout, **options)
        job = read_job(await self._send(submission.call))
        left = submission.left(job)
        return job if left is None else await self.wait(job.id, timeout=left, raise_on_timeout=False)

    async def get(self, job_id: str) -> JobView:
        return read_job(await self._send(get_call(job_id)))

    async def list(self, *, limit: int = 20, cursor: str | None = None, status: str | None = None) -> JobListView:
        return read_page(await self._send(list_call(limit=limit, cursor=cursor, status=status)))

    async def iter_jobs(self, *, status: str | None = None, page_size: int = 50) -> AsyncIterator[JobView]:
        pages = Pages(status=status, page_size=page_size)
        while (call := pages.next_call()) is not None:
            for job in pages.read(await self._send(call)):
                yield job

    async def cancel(self, job_id: str) -> JobView:
        return read_job(await self._send(cancel_call(job_id)))

    async def pipelines(self) -> PipelineList:
        return read_pipelines(await self._send(pipelines_call()))

    async def events(self, job_id: str, *, last_event_id: str | None = None,
                     reconnect: int = 5) -> AsyncIterator[JobEventView]:
        """As ``Client.events``: ``async for event in omni.events(job.id)``."""
        stream = EventStream(job_id, last_event_id=last_event_id, reconnect=reconnect, timeout=self.timeout)
        while (call := stream.next_call()) is not None:
            await asyncio.sleep(stream.pause_s)
            try:
                async with self._open(call) as response:
                    async for line in response.aiter_lines():
                        if (event := stream.feed(line)) is not None:
                            yield event
                        if stream.done:
                            return
                stream.closed(await self.get(job_id))
            except httpx.TransportError as exc:
                stream.dropped(exc)

    async def stream_text(self, job_id: str, *, stage: str | None = None, output: str = "text",
                          last_event_id: str | None = None) -> AsyncIterator[str]:
        """As ``Client.stream_text``: ``async for piece in omni.stream_text(job.id)``."""
        pieces = TextPieces(stage, output)
        async for event in self.events(job_id, last_event_id=last_event_id):
            if piece := pieces.feed(event):
                yield piece

    async def stream_audio(self, job_id: str, *, stage: str | None = None, output: str = "audio",
                           last_event_id: str | None = None) -> AsyncIterator[AudioChunk]:
        """As ``Client.stream_audio``: ``async for chunk in omni.stream_audio(job.id)``."""
        pieces = AudioPieces(stage, output)
        async for event in self.events(job_id, last_event_id=last_event_id):
            if (chunk := pieces.feed(event)) is not None:
                yield chunk

    async def wait(self, job_id: str, *, timeout: float = 600.0, poll_s: float = 0.25,
                   raise_on_timeout: bool = True) -> JobView:
        poll = Poll(job_id, timeout=timeout, poll_s=poll_s, raise_on_timeout=raise_on_timeout)
        while True:
            job = read_job(await self._send(poll.call))
            if (delay := poll.after(job)) is None:
                return job
            await asyncio.sleep(delay)

    async def download(self, output: OutputView, path: str | Path, *, audio_format: AudioFormat | None = None,
                       job_id: str | None = None) -> Path:
        target = download_target(output, path, audio_format)
        call = download_call(output, self.api_url, audio_format=audio_format, job_id=job_id)
        async with self._open(call) as response:
            with target.open("wb") as f:
                async for chunk in response.aiter_bytes():
                    f.write(chunk)
        return target

    async def download_outputs(self, job: JobView | str, directory: str | Path, *,
                               audio_format: AudioFormat | None = None) -> dict[str, Path]:
        info = await self.get(job) if isinstance(job, str) else job
        return {o.name: await self.download(o, path, audio_format=format_for(o, audio_format), job_id=info.id)
                for o, path in output_targets(info, directory, audio_format)}

    @overload
    async def transcribe(self, file: FileInput, *, response_format: JsonFormat = "verbose_json",
                         **options: Unpack[TranscribeOptions]) -> TranscriptionView: ...

    @overload
    async def transcribe(self, file: FileInput, *, response_format: TextFormat,
                         **options: Unpack[TranscribeOptions]) -> str: ...

    @overload
    async def transcribe(self, file: FileInput, *, response_format: str,
                         **options: Unpack[TranscribeOptions]) -> TranscriptionView | str: ...

    async def transcribe(self, file: FileInput, *, response_format: str = "verbose_json",
                         **options: Unpack[TranscribeOptions]) -> TranscriptionView | str:
        """As ``Client.transcribe``."""
        response = await self._send(transcription_call(file, response_format, options))
        return read_transcription(response, response_format)
