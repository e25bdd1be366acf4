"""Audio and video job inputs through the HTTP API and the running system, as image inputs are tested
(test_omni_pipelines.py): base64 in JSON, a multipart part, and the output of an earlier job (a WAV a
text-to-audio job made, an MP4 a text-to-video job made) each stored once under the job's inputs and
recorded with what describes them; a bad file is a 422 naming the field, and no job is made.

The pipeline (tests/media_files.MEDIA_PIPELINE, loaded by the e2e system) has audio and video inputs
beside its prompt; its one AR stage reads the prompt only, so the jobs run on the text workers."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import pytest

from omni_jobs.artifacts import sha256_hex
from tests import media_files as mf
from tests.e2e.helpers import wait_for_job

WAV = mf.wav(0.5)
MP4 = mf.mp4(frames=12, fps=12.0)


def accepted(api: httpx.Client, response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 202, response.text
    job = wait_for_job(api, response.json()["id"])
    assert job["status"] == "succeeded", job["error"]
    return job


def run(api: httpx.Client, input_: dict[str, Any]) -> dict[str, Any]:
    return accepted(api, api.post("/v1/jobs", json={"pipeline": "media-inputs", "input": {"prompt": "hello", **input_}}))


def download(url: str) -> bytes:
    return httpx.get(url, timeout=30).raise_for_status().content


def test_audio_and_video_come_as_base64_and_multipart_parts(api: httpx.Client) -> None:
    by_json = run(api, {"speech": "data:audio/wav;base64," + base64.b64encode(WAV).decode(),
                        "clip": {"data": base64.b64encode(MP4).decode()}})
    response = api.post("/v1/jobs/multipart", data={"pipeline": "media-inputs", "input": json.dumps({"prompt": "hi"})},
                        files={"input.speech": ("speech.mp3", mf.encode_audio("mp3", 0.5), "audio/mpeg"),
                               "input.clip": ("clip.webm", mf.webm(6, 31, 47, 10.0), "video/webm")})
    by_parts = accepted(api, response)
    for job in (by_json, by_parts):
        speech, clip = job["input"]["speech"], job["input"]["clip"]
        assert speech["artifact"]["key"] == f"jobs/{job['id']}/inputs/speech.wav" and speech["media_type"] == "audio/wav"
        assert clip["artifact"]["key"] == f"jobs/{job['id']}/inputs/clip.mp4" and clip["media_type"] == "video/mp4"
        assert (speech["sample_rate"], speech["channels"]) == (16_000, 1) and 0.45 < speech["duration_s"] < 0.6
    assert {k: by_json["input"]["clip"][k] for k in ("frames", "fps", "width", "height", "duration_s")} == {
        "frames": 12, "fps": 12.0, "width": 48, "height": 32, "duration_s": 1.0}
    assert (by_parts["input"]["clip"]["frames"], by_parts["input"]["clip"]["width"]) == (6, 46)  # VP9, re-encoded


def test_an_earlier_jobs_wav_and_mp4_are_inputs_by_reference(api: httpx.Client) -> None:
    sound = accepted(api, api.post("/v1/jobs", json={"pipeline": "text-to-audio", "input": {"prompt": "rain"},
                                                "params": {"audio": {"duration_s": 0.25, "seed": 3}}}))
    video = accepted(api, api.post("/v1/jobs", json={"pipeline": "text-to-video", "input": {"prompt": "a cat"},
                                                "params": {"video": {"seed": 4}}}))
    wav_out = next(o for o in sound["outputs"] if o["type"] == "audio")
    mp4_out = next(o for o in video["outputs"] if o["type"] == "video")
    job = run(api, {"speech": f"{api.base_url}/v1/jobs/{sound['id']}/outputs/{wav_out['name']}",
                    "clip": {"job_id": video["id"], "output": mp4_out["name"]}})
    speech, clip = job["input"]["speech"], job["input"]["clip"]
    assert speech["artifact"]["sha256"] == sha256_hex(download(wav_out["url"]))  # that very 16-bit WAV, stored again
    assert speech["sample_rate"] == wav_out["sample_rate"]
    assert (clip["frames"], clip["width"], clip["height"]) == (mp4_out["frames"], mp4_out["width"], mp4_out["height"])
    wrong = api.post("/v1/jobs", json={"pipeline": "media-inputs", "input": {
        "prompt": "x", "speech": {"job_id": video["id"], "output": mp4_out["name"]},
        "clip": {"job_id": sound["id"], "output": wav_out["name"]}}})
    assert wrong.status_code == 422
    found = {d["loc"][-1]: d["msg"] for d in wrong.json()["detail"]}
    assert "has no audio stream" in found["speech"]  # a video's sound track would do: this one has none
    assert f"names output '{wav_out['name']}' of job '{sound['id']}', which is audio (audio/wav), not a video" \
        in found["clip"]


@pytest.mark.parametrize(
    ("field", "data", "fragment"),
    [
        ("speech", mf.encode_audio("mp3", 2.0)[:1200], "truncated"),
        ("speech", mf.lying_wav(7200.0), "is 7,200 s long (as its header says); at most 600 s (OMNI_MAX_AUDIO_SECONDS)"),
        ("speech", b"plain text, not a sound\n" * 30, "is not audio FFmpeg can read"),
        ("clip", mf.audio_only_mp4(), "has no video stream"),
        ("clip", mf.zip_file(), "is not video FFmpeg can read"),
    ],
    ids=["truncated-mp3", "2-hour-wav-header", "text-as-audio", "audio-only-mp4", "zip-as-mp4"],
)
def test_a_bad_file_is_a_422_naming_the_field_and_makes_no_job(api: httpx.Client, field: str, data: bytes,
                                                               fragment: str) -> None:
    before = [j["id"] for j in api.get("/v1/jobs", params={"limit": 1}).json()["data"]]
    for response in (
        api.post("/v1/jobs", json={"pipeline": "media-inputs",
                                   "input": {"prompt": "x", field: base64.b64encode(data).decode()}}),
        api.post("/v1/jobs/multipart", data={"pipeline": "media-inputs", "input": json.dumps({"prompt": "x"})},
                 files={f"input.{field}": ("file", data, "application/octet-stream")}),
    ):
        assert response.status_code == 422, response.text
        detail = response.json()["detail"]
        assert detail[0]["loc"] == ["body", "input", field] and fragment in detail[0]["msg"], detail
        assert detail[0]["type"] == ("invalid_audio" if field == "speech" else "invalid_video")
    assert [j["id"] for j in api.get("/v1/jobs", params={"limit": 1}).json()["data"]] == before  # none was made
