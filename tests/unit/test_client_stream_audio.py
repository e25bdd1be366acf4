"""``stream_audio`` on both clients: speech deltas out of a job's events, each sample once across a stage's rerun
and a dropped connection, other deltas (text, the talker's speech codes) left out (httpx's MockTransport plays
the server, with the lines of tests/unit/test_client_sse.py)."""

from __future__ import annotations

import base64
import struct

import httpx

from omni_jobs.client import AsyncClient, AudioChunk, Client
from tests.own_loop import run_in_own_loop
from tests.unit.test_client_sse import Script, event_line

CLIP = struct.pack("<1200h", *((i * 37) % 20000 - 10000 for i in range(1200)))
"""1200 samples of 16-bit PCM, as the code2wav stage would stream them."""


def audio(event_id: str, start: int, end: int, *, attempt: int = 1, index: int = 0,
          stage: str = "code2wav") -> list[str]:
    data = CLIP[start * 2:end * 2]
    return event_line(event_id, "output.delta", stage=stage, output="audio", attempt=attempt, index=index,
                      source_attempt=1, format="pcm_s16le", sample_rate=24000, channels=1, start=start,
                      samples=end - start, data=base64.b64encode(data).decode("ascii"))


def speech_script() -> Script:
    """Two chunks; the talker's codes and the text between; a dropped connection; code2wav runs again from 0."""
    return Script([
        (["retry: 10", "", *event_line("1-0", "job.running"), *audio("2-0", 0, 500),
          *event_line("3-0", "output.delta", stage="talker", output="audio_codes", attempt=1, index=0, codes="1 2 3"),
          *event_line("4-0", "output.delta", stage="thinker", output="text", attempt=1, index=0, text="Hi")], True),
        ([*audio("5-0", 500, 800, index=1), *audio("6-0", 0, 600, attempt=2), *audio("7-0", 600, 1200, attempt=2,
                                                                                         index=1),
          *event_line("8-0", "job.succeeded")], False),
    ])


def check(chunks: list[AudioChunk]) -> None:
    assert [(c.start, c.samples, c.sample_rate) for c in chunks] == [(0, 500, 24000), (500, 300, 24000),
                                                                     (800, 400, 24000)]
    assert b"".join(c.pcm for c in chunks) == CLIP


def test_both_clients_hand_out_the_clip_once_across_a_rerun_and_a_dropped_connection() -> None:
    sync_script, async_script = speech_script(), speech_script()
    with Client("http://api.test", api_key="ok_1", transport=httpx.MockTransport(sync_script.respond)) as omni:
        check(list(omni.stream_audio("job_1")))

    async def follow() -> list[AudioChunk]:
        transport = httpx.MockTransport(async_script.respond)
        async with AsyncClient("http://api.test", api_key="ok_1", transport=transport) as omni:
            return [chunk async for chunk in omni.stream_audio("job_1")]

    check(run_in_own_loop(follow()))
    assert sync_script.seen == async_script.seen == [None, "4-0"]


def test_another_stage_or_output_is_not_followed() -> None:
    script = Script([([*audio("1-0", 0, 300, stage="other"), *audio("2-0", 0, 200),
                       *event_line("3-0", "job.succeeded")], False)])
    with Client("http://api.test", api_key="ok_1", transport=httpx.MockTransport(script.respond)) as omni:
        assert [(c.start, c.samples) for c in omni.stream_audio("job_1", stage="code2wav")] == [(0, 200)]
    script = Script([([*audio("1-0", 0, 300), *event_line("2-0", "job.succeeded")], False)])
    with Client("http://api.test", api_key="ok_1", transport=httpx.MockTransport(script.respond)) as omni:
        assert list(omni.stream_audio("job_1", output="speech")) == []
