"""Qwen2.5-Omni's speech through the HTTP API with real workers (thinker on ar, talker on talker, code2wav on
code2wav): the speech is streamed while the talker writes it, and joins to the stored WAV sample for sample
(tests/e2e/test_omni_pipelines.py checks that the in-process ``Omni`` makes the same clip as the queued job)."""

from __future__ import annotations

import io
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from omni_jobs.client import Client, JobEventInfo
from omni_jobs.local.embedded import EmbeddedSystem
from omni_jobs.run.audio_stream import AudioDeltaReader
from tests.e2e.helpers import wait_for_job

CODES = 300
"""Codes the tiny talker writes (it speaks until max_tokens): 6 s of speech at 50 codes a second."""
SAMPLES_PER_CODE = 480
RATE = 24000
TEXT = "Good morning. This sentence is said by the tiny Qwen2.5-Omni, streamed as it is made."


@pytest.fixture
def omni(system: EmbeddedSystem) -> Iterator[Client]:
    with Client(system.api_url, api_key=system.api_key) as client:
        yield client


def _speak(api: httpx.Client, pipeline: str, voice: str, **extra: Any) -> dict[str, Any]:
    body = {"pipeline": pipeline, "input": {"prompt": TEXT, "voice": voice},
            "params": {"talker": {"max_tokens": CODES}}, **extra}
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return dict(response.json())


def _wav(data: bytes) -> tuple[int, int, bytes]:
    with wave.open(io.BytesIO(data)) as w:
        return w.getframerate(), w.getnframes(), w.readframes(w.getnframes())


def test_speech_streams_while_the_talker_writes_and_joins_to_the_stored_wav(
        api: httpx.Client, omni: Client) -> None:
    job = _speak(api, "text-to-speech", "Ethan")
    events: list[JobEventInfo] = list(omni.events(job["id"]))
    final = wait_for_job(api, job["id"])
    assert final["status"] == "succeeded", final["error"]
    stages = {s["id"]: s for s in final["stages"]}
    assert {s: stages[s]["queue"] for s in stages} == {"thinker": "ar", "talker": "talker", "code2wav": "code2wav"}

    types = [(e.type, e.data.get("stage"), e.data.get("output")) for e in events]
    audio = [e for e in events if e.type == "output.delta" and e.data.get("output") == "audio"]
    codes = [e for e in events if e.type == "output.delta" and e.data.get("output") == "audio_codes"]
    assert len(codes) >= 2 and len(audio) >= 3
    # code2wav started while the talker ran, and its first chunk went out before the talker's result
    talker_done = types.index(("stage.succeeded", "talker", None))
    assert types.index(("stage.started", "code2wav", None)) < talker_done
    assert events.index(audio[0]) < talker_done
    assert {(a.data["sample_rate"], a.data["format"], a.data["channels"]) for a in audio} == {(RATE, "pcm_s16le", 1)}

    reader = AudioDeltaReader()
    streamed = b"".join(chunk.pcm for e in audio if (chunk := reader.feed(e.data)) is not None)
    output = next(o for o in final["outputs"] if o["name"] == "audio")
    rate, frames, pcm = _wav(api.get(f"/v1/jobs/{job['id']}/outputs/audio").raise_for_status().content)
    assert (rate, frames) == (RATE, CODES * SAMPLES_PER_CODE) and output["sample_rate"] == RATE
    assert output["duration_s"] == pytest.approx(CODES * SAMPLES_PER_CODE / RATE)
    assert streamed == pcm  # what was heard is what is stored
    text = next(o for o in final["outputs"] if o["name"] == "text")
    assert text["text"] == TEXT  # text-to-speech says the text, word for word


def test_a_voice_the_checkpoint_lacks_is_refused_naming_the_voices(api: httpx.Client) -> None:
    response = api.post("/v1/jobs", json={"pipeline": "omni-chat", "input": {"prompt": "hi", "voice": "Alice"}})
    assert response.status_code == 422
    assert "one of Chelsie, Ethan" in response.text and "voice" in response.text


def test_openai_speech_in_pcm_streams_its_body_while_the_job_runs(api: httpx.Client, system: EmbeddedSystem) -> None:
    """``/v1/audio/speech`` with ``response_format: pcm``: the body's first bytes arrive before the job's talker is
    done (the speech as it is made), and the whole body is the stored clip's samples (24 kHz pcm16)."""
    import time

    from openai import OpenAI

    with OpenAI(base_url=f"{system.api_url}/v1", api_key=system.api_key, timeout=300) as client, \
            client.audio.speech.with_streaming_response.create(
                model="text-to-speech", voice="Chelsie", input=TEXT, response_format="pcm",
                extra_body={"params": {"talker": {"max_tokens": CODES}}}) as response:
        job_id = response.headers["x-omni-job-id"]
        pieces, first_at_talker = [], None
        for piece in response.iter_bytes():
            if not pieces:
                stages = {s["id"]: s["status"] for s in api.get(f"/v1/jobs/{job_id}").json()["stages"]}
                first_at_talker = stages["talker"]
            pieces.append(piece)
            time.sleep(0)
    assert first_at_talker == "running"  # audio came out while the talker still wrote codes
    _rate, _frames, pcm = _wav(api.get(f"/v1/jobs/{job_id}/outputs/audio").raise_for_status().content)
    assert b"".join(pieces) == pcm
