"""Speech out through the OpenAI-compatible routes, with the official ``openai`` client and the real system
(Qwen2.5-Omni's thinker, talker and code2wav on their own workers): ``/v1/audio/speech`` on text-to-speech
(streamed body, every format), chat with ``modalities: ["text", "audio"]`` on omni-chat, whole and streamed
(``delta.audio``), and a job's audio output downloaded in another format.

Each clip is decoded back (wave, PyAV): 24 kHz, as long as the job's output says, in the voice asked (the job's
input). Format conversions are omni_jobs.media.audio_formats (unit-tested per format); here they are shown on the
wire: media types, the ``format`` query, the 400s and 422s that name the field and the choices.
"""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Iterator
from typing import Any

import av
import httpx
import openai
import pytest
from openai import OpenAI

from omni_jobs.local.embedded import EmbeddedSystem

RATE = 24000
MESSAGES: list[Any] = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def client(system: EmbeddedSystem) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{system.api_url}/v1", api_key=system.api_key, timeout=300) as c:
        yield c


def job_of(api: httpx.Client, headers: Any) -> dict[str, Any]:
    return api.get(f"/v1/jobs/{headers['x-omni-job-id']}").raise_for_status().json()


def output(job: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [o for o in job["outputs"] if o["name"] == name]
    return found


def wav_seconds(data: bytes) -> tuple[int, int, float]:
    """(rate, channels, seconds) of a WAV."""
    with wave.open(io.BytesIO(data)) as w:
        return w.getframerate(), w.getnchannels(), w.getnframes() / w.getframerate()


def decoded_seconds(data: bytes) -> tuple[str, float]:
    """(codec, seconds) of a compressed file, decoded with PyAV."""
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        frames = list(container.decode(stream))
        return stream.codec_context.name, sum(f.samples for f in frames) / frames[0].sample_rate


def test_speech_streams_a_24khz_wav_in_the_voice_asked(client: OpenAI, api: httpx.Client) -> None:
    with client.audio.speech.with_streaming_response.create(model="text-to-speech", voice="Ethan", input="Hello there",
                                                            response_format="wav") as response:
        assert response.headers["content-type"] == "audio/wav"
        data = b"".join(response.iter_bytes(4096))
        job = job_of(api, response.headers)
    assert job["pipeline"] == "text-to-speech" and job["input"]["voice"] == "Ethan"
    audio = output(job, "audio")
    rate, channels, seconds = wav_seconds(data)
    assert (rate, channels) == (RATE, 1) and audio["sample_rate"] == RATE
    assert seconds == pytest.approx(audio["duration_s"], abs=1e-3) and seconds > 0

    # the same job's audio, downloaded in other formats: each decodes back as long as the clip
    for fmt, codec in (("mp3", "mp3float"), ("flac", "flac"), ("opus", "opus"), ("aac", "aac")):
        got = api.get(f"/v1/jobs/{job['id']}/outputs/audio", params={"format": fmt})
        assert got.status_code == 200, got.text
        assert got.headers["content-disposition"].endswith(f'.{fmt}"')
        name, length = decoded_seconds(got.content)
        assert name == codec and length == pytest.approx(seconds, abs=0.1)  # AAC in ADTS keeps its encoder delay
    pcm = api.get(f"/v1/jobs/{job['id']}/outputs/audio", params={"format": "pcm"})
    assert pcm.headers["content-type"] == "audio/pcm" and len(pcm.content) == 2 * round(seconds * RATE)
    assert api.get(f"/v1/jobs/{job['id']}/outputs/audio").content == data  # as stored: the WAV


def test_speech_is_mp3_by_default_and_opus_or_flac_on_request(client: OpenAI, api: httpx.Client) -> None:
    raw = client.audio.speech.with_raw_response.create(model="text-to-speech", voice="Chelsie", input="Good morning")
    assert raw.headers["content-type"] == "audio/mpeg"  # OpenAI's default format
    job = job_of(api, raw.headers)
    seconds = output(job, "audio")["duration_s"]
    codec, length = decoded_seconds(raw.content)
    assert codec == "mp3float" and length == pytest.approx(seconds, abs=0.05)
    assert job["input"]["voice"] == "Chelsie"
    for fmt, media_type, codec in (("flac", "audio/flac", "flac"), ("opus", "audio/ogg", "opus")):
        again = client.audio.speech.with_raw_response.create(model="text-to-speech", voice="Chelsie",
                                                             input="Good morning", response_format=fmt)
        assert again.headers["content-type"] == media_type
        name, length = decoded_seconds(again.content)
        assert name == codec and length == pytest.approx(seconds, abs=0.05)  # the same seeds: the same clip


def test_chat_answers_text_and_speech_in_the_format_and_voice_asked(client: OpenAI, api: httpx.Client) -> None:
    raw = client.chat.completions.with_raw_response.create(model="omni-chat", modalities=["text", "audio"],
                                                           audio={"voice": "Ethan", "format": "wav"}, messages=MESSAGES)
    chat = raw.parse()
    job = job_of(api, raw.headers)
    assert job["pipeline"] == "omni-chat" and job["input"]["voice"] == "Ethan"
    text, speech = chat.choices  # one choice per modality
    assert text.message.content == output(job, "text")["text"]
    audio = speech.message.audio
    assert audio is not None and audio.transcript == text.message.content and audio.id == f"audio_{job['id']}"
    assert audio.expires_at > job["completed_at"]
    rate, channels, seconds = wav_seconds(base64.b64decode(audio.data))
    assert (rate, channels) == (RATE, 1) and seconds == pytest.approx(output(job, "audio")["duration_s"], abs=1e-3)


def test_a_streamed_chat_sends_transcript_and_pcm16_as_openai_does(client: OpenAI, api: httpx.Client) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="omni-chat", modalities=["text", "audio"], audio={"voice": "Ethan", "format": "pcm16"},
        messages=MESSAGES, stream=True, stream_options={"include_usage": True})
    job_id = raw.headers["x-omni-job-id"]
    chunks = list(raw.parse())
    pieces = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio is not None]
    assert pieces and all(a.id == f"audio_{job_id}" for a in pieces)
    transcript = "".join(a.transcript or "" for a in pieces)
    pcm = b"".join(base64.b64decode(a.data) for a in pieces if a.data)
    assert pieces[-1].expires_at is not None and pieces[-1].data is None
    assert all(a.expires_at is None for a in pieces[:-1])
    job = api.get(f"/v1/jobs/{job_id}").raise_for_status().json()
    assert job["status"] == "succeeded" and job["input"]["voice"] == "Ethan"
    assert transcript == output(job, "text")["text"]
    assert len(pcm) / 2 / RATE == pytest.approx(output(job, "audio")["duration_s"], abs=0.01)
    whole = api.get(f"/v1/jobs/{job_id}/outputs/audio", params={"format": "pcm"}).content
    assert abs(len(pcm) - len(whole)) <= 2 * 240  # the clip, whether deltas or the final WAV carried it
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    assert chunks[-1].usage is not None and not chunks[-1].choices


def test_speech_as_sse_events_joins_to_the_clip(client: OpenAI, api: httpx.Client) -> None:
    with client.audio.speech.with_streaming_response.create(model="text-to-speech", voice="Ethan", input="Hello there",
                                                            response_format="pcm", stream_format="sse") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
        job_id = response.headers["x-omni-job-id"]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) > 1
    assert events[-1]["type"] == "speech.audio.done" and set(events[-1]["usage"]) == {
        "input_tokens", "output_tokens", "total_tokens"}
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    whole = api.get(f"/v1/jobs/{job_id}/outputs/audio", params={"format": "pcm"}).content
    assert abs(len(pcm) - len(whole)) <= 2 * 240  # the clip, whether deltas or the final WAV carried it


@pytest.mark.parametrize(("call", "param", "fragment"), [
    (lambda c: c.audio.speech.create(model="text-to-speech", voice="alloy", input="hi"), "voice",
     "voices: Chelsie, Ethan"),
    (lambda c: c.audio.speech.create(model="text-to-speech", voice="Ethan", input="hi",
                                     extra_body={"response_format": "ogg"}), "response_format",
     "one of mp3, opus, aac, flac, wav, pcm"),
    (lambda c: c.chat.completions.create(model="omni-chat", modalities=["text", "audio"], messages=MESSAGES,
                                         audio={"voice": "Ethan", "format": "wav"}, stream=True), "audio.format",
     "pcm16"),
    (lambda c: c.chat.completions.create(model="omni-chat", modalities=["text", "audio"], messages=MESSAGES,
                                         audio={"voice": "nova", "format": "mp3"}), "audio.voice", "Chelsie, Ethan"),
], ids=["openai-voice", "format", "streamed-wav", "chat-voice"])
def test_bad_speech_requests_are_400_naming_the_field(client: OpenAI, call: Any, param: str, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        call(client)
    assert err.value.param == param, err.value.body
    assert fragment in err.value.message


def test_format_on_a_non_audio_output_or_an_unknown_one_is_422_naming_it(api: httpx.Client) -> None:
    job = api.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "hi"},
                                     "params": {"ar": {"max_tokens": 2}}}, headers={"Prefer": "wait=60"}).json()
    assert job["status"] == "succeeded"
    text = api.get(f"/v1/jobs/{job['id']}/outputs/text", params={"format": "mp3"})
    assert text.status_code == 422 and text.json()["detail"][0]["loc"] == ["query", "format"]
    assert "converts WAV audio outputs only" in text.json()["detail"][0]["msg"]
    unknown = api.get(f"/v1/jobs/{job['id']}/outputs/text", params={"format": "ogg"})
    assert unknown.status_code == 422 and unknown.json()["detail"][0]["loc"] == ["query", "format"]
    assert "'mp3'" in unknown.json()["detail"][0]["msg"] and "'pcm'" in unknown.json()["detail"][0]["msg"]
