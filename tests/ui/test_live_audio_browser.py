"""The job page plays speech while it streams: chromium on the real app (under uvicorn, auth off, real Redis), a
queued text-to-speech job (no workers: it waits) whose event stream the test writes audio deltas to, in the
code2wav stage's shape. The player counts the seconds received, applies the rerun rule (a stage run again starts
over from sample 0: only what is beyond counts), and once "Listen live" is pressed schedules what arrived and
keeps up. Chromium's headless audio goes to no device, which is all the Web Audio API needs here."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import uvicorn

from api.main import create_app
from omni_jobs.core.keys import job_events
from omni_jobs.core.settings import Settings
from omni_jobs.local.devservices import free_port
from tests.ui.conftest import screenshot

pytestmark = [pytest.mark.ui, pytest.mark.integration]

RATE = 24000
CHUNK = 11520  # 0.48 s, as code2wav streams it


@pytest.fixture
def api_url(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> Iterator[str]:
    settings = Settings(redis_url=redis_url, artifacts_dir=tmp_path / "a", models_dir=tmp_path / "m",
                        auth_enabled=False)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the API did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def page(browser: Any, api_url: str) -> Iterator[Any]:
    """A page on the app; any script error or Content-Security-Policy violation fails the test."""
    problems: list[str] = []
    context = browser.new_context(base_url=api_url, viewport={"width": 1280, "height": 900})
    context.set_default_timeout(15_000)
    page = context.new_page()
    page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(f"script error: {error}"))
    yield page
    context.close()
    assert not problems, problems


def audio_delta(start: int, samples: int, *, attempt: int = 1, index: int = 0) -> dict[str, Any]:
    pcm = b"".join(int(8000 * ((i // 40) % 2 * 2 - 1)).to_bytes(2, "little", signed=True)
                   for i in range(start, start + samples))  # a 300 Hz square wave
    return {"stage": "code2wav", "output": "audio", "attempt": attempt, "index": index, "source_attempt": 1,
            "format": "pcm_s16le", "sample_rate": RATE, "channels": 1, "start": start, "samples": samples,
            "data": base64.b64encode(pcm).decode("ascii")}


def emitter(redis_client: redis.Redis, job_id: str) -> Callable[..., None]:
    def emit(*deltas: dict[str, Any]) -> None:
        for data in deltas:
            event = {"job_id": job_id, "type": "output.delta", "at": time.time(), "data": data}
            redis_client.xadd(job_events(job_id), {"event": json.dumps(event)})
    return emit


def seconds(page: Any, attribute: str) -> float:
    holder = "#live-audio-received" if attribute == "data-seconds" else "#live-audio"
    return float(page.locator(holder).get_attribute(attribute) or 0)


def wait_seconds(page: Any, attribute: str, value: float) -> None:
    holder = "#live-audio-received" if attribute == "data-seconds" else "#live-audio"
    page.wait_for_function(f"() => document.querySelector('{holder}').getAttribute('{attribute}') === '{value:.3f}'")


def test_the_job_page_plays_streamed_speech_and_counts_what_arrived(page: Any, api_url: str,
                                                                   redis_client: redis.Redis) -> None:
    job = httpx.post(f"{api_url}/v1/jobs", json={"pipeline": "text-to-speech", "input": {"prompt": "Hello"}})
    assert job.status_code == 202, job.text
    job_id = job.json()["id"]
    emit = emitter(redis_client, job_id)
    page.goto(f"/ui/jobs/{job_id}")
    page.wait_for_function("() => document.querySelector('[data-job-stream]').getAttribute('data-live') === 'open'")
    assert page.locator("#live-audio").is_hidden()  # no audio yet

    emit({"stage": "talker", "output": "audio_codes", "attempt": 1, "index": 0, "codes": "1 2 3"},
         audio_delta(0, CHUNK), audio_delta(CHUNK, CHUNK, index=1))
    wait_seconds(page, "data-seconds", 2 * CHUNK / RATE)
    assert page.locator("#live-audio").is_visible() and page.locator("#job-live").is_visible()
    assert page.locator("#live-audio-received").inner_text() == "1.0 s of speech received"
    # code2wav runs again: its audio from sample 0; only what is beyond the 0.96 s received counts
    emit(audio_delta(0, CHUNK + CHUNK // 2, attempt=2), audio_delta(CHUNK + CHUNK // 2, CHUNK, attempt=2, index=1))
    wait_seconds(page, "data-seconds", 2.5 * CHUNK / RATE)
    assert page.locator("#job-live pre").count() == 0  # neither audio nor speech codes are shown as text

    page.click("#live-audio-toggle")
    page.wait_for_function("() => document.querySelector('#live-audio').getAttribute('data-state') === 'playing'")
    assert page.locator("#live-audio-toggle").get_attribute("aria-pressed") == "true"
    assert page.locator("#live-audio-toggle").inner_text() == "Stop"
    wait_seconds(page, "data-scheduled", 2.5 * CHUNK / RATE)  # what arrived so far, scheduled at once
    emit(audio_delta(int(2.5 * CHUNK), CHUNK, attempt=2, index=2))
    wait_seconds(page, "data-scheduled", 3.5 * CHUNK / RATE)  # and it keeps up
    wait_seconds(page, "data-seconds", 3.5 * CHUNK / RATE)
    screenshot(page, "job-live-audio")

    page.click("#live-audio-toggle")
    page.wait_for_function("() => document.querySelector('#live-audio').getAttribute('data-state') === 'idle'")
    assert page.locator("#live-audio-status").inner_text() == "Stopped."
    assert page.locator("#live-audio-toggle").inner_text() == "Listen live"

    # The job ends (canceled here: no stored clip): what was received can still be played, to its end.
    assert httpx.post(f"{api_url}/v1/jobs/{job_id}/cancel").status_code == 200
    page.wait_for_function("() => document.querySelector('[data-job-stream]').getAttribute('data-status') === 'canceled'")
    assert "canceled" in page.locator("#live-audio-status").inner_text()
    page.click("#live-audio-toggle")
    page.wait_for_function("() => document.querySelector('#live-audio-status').textContent === "
                           "'Played what was received.'", timeout=15_000)
