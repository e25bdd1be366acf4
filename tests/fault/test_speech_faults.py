"""Qwen2.5-Omni's speech survives the death of either speech worker mid-stream (SIGKILL, restarted at once): the
stage runs again, a listener of the job's audio deltas hears one clip (a rerun's repeat of what was heard is
skipped: the AudioDeltaReader's rule), the stored WAV is those samples, and it is the clip a fault-free run makes
(talker and code2wav sample from fixed seeds)."""

from __future__ import annotations

import io
import time
import wave
from typing import Any

import httpx
import redis

from omni_jobs.core import keys
from omni_jobs.run.audio_stream import AudioDeltaReader
from tests.e2e.helpers import wait_for_job
from tests.fault.conftest import FaultSystem
from tests.fault.test_faults import RECOVERY_BOUND_S, duplicates, events_of, report, wait_until

CODES = 600
"""12 s of speech: the talker writes for a few seconds on these cores, code2wav renders a chunk every 24 codes."""
TEXT = "A sentence said while its workers are killed."


def _speak(api: httpx.Client) -> dict[str, Any]:
    response = api.post("/v1/jobs", json={"pipeline": "text-to-speech", "input": {"prompt": TEXT},
                                          "params": {"talker": {"max_tokens": CODES}}})
    assert response.status_code == 202, response.text
    return dict(response.json())


def _pcm(api: httpx.Client, job_id: str) -> bytes:
    data = api.get(f"/v1/jobs/{job_id}/outputs/audio").raise_for_status().content
    with wave.open(io.BytesIO(data)) as w:
        assert w.getframerate() == 24000
        return w.readframes(w.getnframes())


def _audio_deltas(api: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    return [e["data"] for e in events_of(api, job_id)
            if e["type"] == "output.delta" and e["data"].get("output") == "audio"]


def _first_chunk_out(faults: FaultSystem, api: httpx.Client, job_id: str) -> bool:
    """code2wav has published audio while the talker still writes (read from the job's stream in Redis)."""
    job = api.get(f"/v1/jobs/{job_id}").json()
    talker = next(s for s in job["stages"] if s["id"] == "talker")
    if talker["status"] != "running":
        return False
    client = redis.Redis.from_url(faults.state.url)
    try:
        entries = client.xrange(keys.job_events(job_id))
    finally:
        client.close()
    return any(b'"output":"audio"' in value for _id, fields in entries for value in fields.values())


def _kill_mid_stream(faults: FaultSystem, api: httpx.Client, worker: str, stage: str) -> None:
    clean = wait_for_job(api, _speak(api)["id"], timeout_s=300)
    assert clean["status"] == "succeeded", clean["error"]
    job = _speak(api)
    wait_until(lambda: _first_chunk_out(faults, api, job["id"]), timeout_s=180, what="a chunk of speech out mid-stream")
    process = faults.process(worker)
    process.kill()
    killed_at = time.time()
    process.start()
    done = wait_for_job(api, job["id"], timeout_s=300)
    assert done["status"] == "succeeded", done["error"]
    attempts = {s["id"]: s["attempts"] for s in done["stages"]}
    assert attempts == {"thinker": 1, "talker": 2 if stage == "talker" else 1, "code2wav": 2 if stage == "code2wav" else 1}
    deltas = _audio_deltas(api, job["id"])
    reader = AudioDeltaReader()
    heard = b"".join(chunk.pcm for d in deltas if (chunk := reader.feed(d)) is not None)
    stored = _pcm(api, job["id"])
    assert heard == stored  # one clip: nothing heard twice, nothing missing
    assert stored == _pcm(api, clean["id"])  # the clip a fault-free run makes
    reruns = {(d["attempt"], d["source_attempt"]) for d in deltas}
    assert len(reruns) >= 2, reruns  # the stream restarted under the new attempt, and readers coped
    code2wav = next(s for s in done["stages"] if s["id"] == "code2wav")
    assert code2wav["finished_at"] - killed_at < RECOVERY_BOUND_S + 120
    duplicated = duplicates(faults, [done], outputs_per_job=2)
    assert duplicated == 0
    report(f"SIGKILL {stage} worker mid-stream, restarted at once", [done], duplicated,
           done["completed_at"] - killed_at)


def test_sigkill_the_talker_worker_mid_stream(faults: FaultSystem, api: httpx.Client) -> None:
    _kill_mid_stream(faults, api, "worker-talker", "talker")


def test_sigkill_the_code2wav_worker_mid_stream(faults: FaultSystem, api: httpx.Client) -> None:
    _kill_mid_stream(faults, api, "worker-code2wav", "code2wav")
