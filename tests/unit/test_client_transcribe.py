"""Client.transcribe / AsyncClient.transcribe: the form they send (as the openai client sends it) and
how they read each response format; the CLI command prints it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from omni_jobs.cli.app import main
from omni_jobs.client import AsyncClient, Client, InvalidRequestError, TranscriptionView
from tests.own_loop import run_in_own_loop

VERBOSE = {"task": "transcribe", "language": "en", "duration": 1.5, "text": "Hi.",
           "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": 1.5, "text": "Hi.", "tokens": [],
                         "temperature": 0.0, "avg_logprob": 0.0, "compression_ratio": 0.3, "no_speech_prob": 0.0}],
           "usage": {"type": "duration", "seconds": 1.5}}


def fake_api(seen: list[httpx.Request]) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = request.read().decode("latin-1")
        headers = {"x-omni-job-id": "job_1"}
        if 'name="model"\r\n\r\nnope' in body:
            return httpx.Response(400, json={"error": {"message": "pipeline 'nope' ...", "type": "invalid_request_error",
                                                       "param": "model", "code": "unsupported_pipeline"}})
        if 'name="response_format"\r\n\r\nsrt' in body:
            return httpx.Response(200, text="1\n00:00:00,000 --> 00:00:01,500\nHi.\n\n", headers=headers)
        return httpx.Response(200, json=VERBOSE, headers=headers)

    return httpx.MockTransport(answer)


def form_of(request: httpx.Request) -> str:
    return request.read().decode("latin-1")


def test_the_form_and_the_answers(tmp_path: Path) -> None:
    seen: list[httpx.Request] = []
    clip = tmp_path / "hello.wav"
    clip.write_bytes(b"RIFF....WAVE")
    with Client("http://api", api_key="k", transport=fake_api(seen)) as omni:
        result = omni.transcribe(clip, language="en", temperature=0.2)
        assert isinstance(result, TranscriptionView) and result.duration == 1.5 and result.job_id == "job_1"
        assert result.segments[0].end == 1.5
        subtitles = omni.transcribe(b"RIFF", response_format="srt", translate=True)
        assert subtitles.startswith("1\n00:00:00,000 --> 00:00:01,500")
        with pytest.raises(InvalidRequestError) as err:
            omni.transcribe(b"RIFF", model="nope")
        assert err.value.param == "model"
    first, second, _ = seen
    assert first.url.path == "/v1/audio/transcriptions" and second.url.path == "/v1/audio/translations"
    assert first.headers["authorization"] == "Bearer k"
    body = form_of(first)
    for part in ('name="model"\r\n\r\nspeech-to-text', 'name="response_format"\r\n\r\nverbose_json',
                 'name="language"\r\n\r\nen', 'name="temperature"\r\n\r\n0.2', 'name="file"; filename="hello.wav"'):
        assert part in body
    assert 'name="prompt"' not in body  # what is not given is not sent


def test_the_async_client_the_same() -> None:
    seen: list[httpx.Request] = []

    async def run() -> TranscriptionView:
        async with AsyncClient("http://api", transport=fake_api(seen)) as omni:
            return await omni.transcribe(b"RIFF", response_format="json")

    assert run_in_own_loop(run()).text == "Hi."  # Playwright's loop may run in this thread
    assert 'name="response_format"\r\n\r\njson' in form_of(seen[0])


def test_the_cli_prints_the_transcription(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[httpx.Request] = []
    real = httpx.Client.__init__

    def with_fake(self: httpx.Client, *args: object, **kwargs: object) -> None:
        real(self, *args, **{**kwargs, "transport": fake_api(seen)})  # type: ignore[arg-type]

    monkeypatch.setattr(httpx.Client, "__init__", with_fake)
    clip = tmp_path / "hello.wav"
    clip.write_bytes(b"RIFF")
    assert main(["transcribe", str(clip), "--format", "srt", "--api-url", "http://api"]) == 0
    assert capsys.readouterr().out == "1\n00:00:00,000 --> 00:00:01,500\nHi.\n\n"
    assert main(["transcribe", str(clip), "--json", "--language", "en", "--api-url", "http://api"]) == 0
    assert json.loads(capsys.readouterr().out)["segments"][0]["text"] == "Hi."
    assert 'name="language"\r\n\r\nen' in form_of(seen[-1])
    assert main(["transcribe", str(tmp_path / "missing.wav"), "--api-url", "http://api"]) == 2
