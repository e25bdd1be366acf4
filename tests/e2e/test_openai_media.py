"""Media through the OpenAI-compatible routes, with the official ``openai`` client and the real system:
images and audio in chat messages (streamed too), and speech to text in every response format.

Each medium is shown to reach the model by what the model's processor makes of it: the prompt's
tokens (vLLM's usage) grow with the image's size and the clip's length. A transcription's duration is
the clip's, and its srt/vtt cues are timed by its segments.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI
from PIL import Image

from omni_jobs.client import Client
from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.helpers import submit, wait_for_job
from tests.media_files import wav

CLIP_S = 2.5


@pytest.fixture
def client(system: EmbeddedSystem) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{system.api_url}/v1", api_key=system.api_key, timeout=300) as c:
        yield c


def png(width: int, height: int) -> bytes:
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x * y) % 256], axis=-1).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def audio_part(seconds: float) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(seconds)).decode(), "format": "wav"}}


def user(*parts: dict[str, Any], text: str = "What is in it?") -> list[Any]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


def job_of(api: httpx.Client, raw: Any) -> dict[str, Any]:
    return api.get(f"/v1/jobs/{raw.headers['x-omni-job-id']}").raise_for_status().json()


def text_output(job: dict[str, Any]) -> str:
    (text,) = [o["text"] for o in job["outputs"] if o["name"] == "text"]
    return str(text)


def test_chat_with_an_image_on_image_to_text(client: OpenAI, api: httpx.Client, system: EmbeddedSystem) -> None:
    def ask(width: int, height: int) -> tuple[Any, dict[str, Any]]:
        raw = client.chat.completions.with_raw_response.create(
            model="image-to-text", max_tokens=4, messages=user(image_part(data_uri(png(width, height), "image/png"))))
        return raw.parse(), job_of(api, raw)

    small, small_job = ask(56, 56)
    large, _ = ask(112, 112)
    assert small.model == "image-to-text" and small_job["pipeline"] == "image-to-text"
    assert small_job["input"]["prompt"] == "What is in it?"
    assert (small_job["input"]["image"]["width"], small_job["input"]["image"]["height"]) == (56, 56)
    assert small.choices[0].message.content == text_output(small_job)
    assert small.usage is not None and large.usage is not None
    assert large.usage.prompt_tokens > small.usage.prompt_tokens  # 4x the pixels: more vision tokens

    # Any other model name with an image runs image-to-text; the image may be an output this system stores.
    made = wait_for_job(api, submit(api, "text-to-image", "a red square",
                                    {"dit": {"height": 32, "width": 48, "num_inference_steps": 2}})["id"])
    stored = f"{system.api_url}/v1/jobs/{made['id']}/outputs/image"
    raw = client.chat.completions.with_raw_response.create(model="gpt-4o", max_tokens=2,
                                                           messages=user(image_part(stored)))
    job = job_of(api, raw)
    assert raw.parse().model == "image-to-text"
    assert (job["input"]["image"]["width"], job["input"]["image"]["height"]) == (48, 32)


def test_chat_with_input_audio_on_omni_understanding(client: OpenAI, api: httpx.Client) -> None:
    def ask(seconds: float, model: str = "omni-understanding") -> tuple[Any, dict[str, Any]]:
        raw = client.chat.completions.with_raw_response.create(model=model, max_tokens=2,
                                                               messages=user(audio_part(seconds), text="What do you hear?"))
        return raw.parse(), job_of(api, raw)

    short, short_job = ask(1.0)
    long, long_job = ask(3.0, model="gpt-4o-audio-preview")  # any other name: chosen by the audio part
    assert long.model == "omni-understanding" and long_job["pipeline"] == "omni-understanding"
    assert (short_job["input"]["audio"]["duration_s"], long_job["input"]["audio"]["duration_s"]) == (1.0, 3.0)
    assert short.usage is not None and long.usage is not None
    assert long.usage.prompt_tokens > short.usage.prompt_tokens  # ~25 audio tokens a second
    assert short.choices[0].message.content == text_output(short_job)


def test_a_streamed_chat_with_an_image_is_the_whole_answer_in_pieces(client: OpenAI) -> None:
    messages = user(image_part(data_uri(png(56, 56), "image/png")))
    whole = client.chat.completions.create(model="image-to-text", max_tokens=6, messages=messages)
    chunks = list(client.chat.completions.create(model="image-to-text", max_tokens=6, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens  # the image counted the same


@pytest.mark.parametrize(("call", "param", "fragment"), [
    (lambda c: c.chat.completions.create(model="text-to-text", messages=user(image_part("data:image/png;base64,AA"))),
     "messages[0].content[1]", "models that take it: image-to-text"),
    (lambda c: c.chat.completions.create(model="image-to-text", messages=user(image_part(
        data_uri(wav(0.5), "audio/wav")))), "messages[0].content[1]", "not an image"),
    (lambda c: c.chat.completions.create(model="image-to-text", messages=user()), "messages", "needs an image part"),
    (lambda c: c.audio.transcriptions.create(model="text-to-text", file=("a.wav", wav(0.5))), "model",
     "is no speech-to-text pipeline"),
    (lambda c: c.audio.transcriptions.create(model="whisper-1", file=("a.png", png(8, 8))), "file", "audio"),
    (lambda c: c.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav(0.5)), language="english"),
     "language", "pattern"),
], ids=["part-not-taken", "not-an-image", "image-missing", "not-speech", "not-audio", "language"])
def test_bad_media_requests_are_400_naming_the_field(client: OpenAI, call: Any, param: str, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        call(client)
    assert err.value.param == param, err.value.body
    assert fragment in err.value.message


def test_transcriptions_in_every_format(client: OpenAI, api: httpx.Client, system: EmbeddedSystem,
                                        tmp_path: Path) -> None:
    clip = tmp_path / "clip.wav"
    clip.write_bytes(wav(CLIP_S, rate=22_050))  # resampled to Whisper's 16 kHz: the same length
    with clip.open("rb") as f:
        raw = client.audio.transcriptions.with_raw_response.create(model="speech-to-text", file=f)
    job = job_of(api, raw)
    as_json = raw.parse()
    assert job["pipeline"] == "speech-to-text" and job["params"]["asr"]["task"] == "transcribe"
    assert job["input"]["audio"]["duration_s"] == CLIP_S
    assert as_json.text == text_output(job)

    with clip.open("rb") as f:
        verbose = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="verbose_json")
    assert (verbose.duration, verbose.text) == (CLIP_S, as_json.text)  # the same (greedy) text, with its times
    assert len(verbose.language) == 2  # detected: an ISO 639-1 code
    assert verbose.segments is not None
    assert [(s.id, s.start, s.end, s.seek) for s in verbose.segments] == [(0, 0.0, CLIP_S, 0)]
    with clip.open("rb") as f:
        assert client.audio.transcriptions.create(model="whisper-1", file=f, response_format="text") == as_json.text
    with clip.open("rb") as f:
        subtitles = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="srt")
    with clip.open("rb") as f:
        web = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="vtt")
    assert web.startswith("WEBVTT\n\n")
    if as_json.text.strip():  # one cue per segment with text, timed as the segment
        assert subtitles == f"1\n00:00:00,000 --> 00:00:02,500\n{verbose.segments[0].text.strip()}\n\n"
        assert "00:00:00.000 --> 00:00:02.500\n" in web
    else:
        assert subtitles == "" and web == "WEBVTT\n\n"

    with clip.open("rb") as f:
        named = client.audio.transcriptions.with_raw_response.create(model="whisper-1", file=f, language="de",
                                                                     response_format="verbose_json")
    assert job_of(api, named)["params"]["asr"]["language"] == "de" and named.parse().language == "de"

    with Client(system.api_url, api_key=system.api_key) as omni:  # the project's own client, the same answer
        assert omni.transcribe(clip, response_format="srt") == subtitles
        mine = omni.transcribe(clip)
        assert mine.duration == CLIP_S and mine.job_id is not None and mine.text == as_json.text


def test_translations_run_the_translate_task(client: OpenAI, api: httpx.Client) -> None:
    raw = client.audio.translations.with_raw_response.create(model="whisper-1", file=("clip.wav", wav(1.5)),
                                                             response_format="verbose_json")
    job = job_of(api, raw)
    translated = raw.parse()
    assert job["params"]["asr"]["task"] == "translate"
    assert translated.duration == 1.5 and translated.text == text_output(job)
    assert translated.language == "en"  # the text's language, as OpenAI's translations say
    assert translated.model_extra is not None and translated.model_extra["task"] == "translate"
