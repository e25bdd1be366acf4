"""The requests both clients send and how they read answers (omni_jobs/client/protocol.py), on the
job JSON the server really builds (present_job), and the client's light import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from omni_jobs.artifacts import ArtifactRef, artifact_store_from_settings
from omni_jobs.client import JobInfo, JobView, output_filename
from omni_jobs.client.protocol import (
    Pages,
    Poll,
    Submission,
    client_headers,
    download_call,
    get_call,
    read_job,
)
from omni_jobs.core.settings import Settings
from omni_jobs.jobs.models import Job, JobOutput, JobStatus, StageRecord
from omni_jobs.jobs.view import present_job

ROOT = Path(__file__).resolve().parents[2]
API = "http://api.test:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def job_json(tmp_path: Path, status: JobStatus = JobStatus.succeeded, **extra: Any) -> dict[str, Any]:
    ref = ArtifactRef(backend="local", key="jobs/job_1/outputs/image.png", media_type="image/png", size=3,
                      sha256="0" * 64)
    job = Job(id="job_1", pipeline="text-to-image", status=status, input={"prompt": "x"}, created_at=10.0,
              stages=[StageRecord(id="dit", engine="dit", queue="dit", outputs={"image": ref})],
              outputs=[JobOutput(name="image", type="image", media_type="image/png", size=3, artifact=ref,
                                 width=2, height=1)])
    store = artifact_store_from_settings(Settings(artifacts_dir=tmp_path))
    return {**present_job(job, public_url=API, artifacts=store), **extra}


def test_the_client_reads_the_servers_job_json_and_ignores_fields_it_does_not_know(tmp_path: Path) -> None:
    data = job_json(tmp_path, future_field=1)
    data["stages"][0]["outputs"]["image"]["encoding"] = "zstd"  # a newer server's field, deep inside
    data["outputs"][0]["color_space"] = "srgb"
    job = read_job(httpx.Response(200, content=json.dumps(data).encode()))
    assert isinstance(job, JobView) and JobInfo is JobView
    assert job.is_final and job.status == "succeeded" and job.status.value == "succeeded"
    image = job.output("image")
    assert image is not None and (image.width, image.height, image.url) == (2, 1, f"{API}/v1/jobs/job_1/outputs/image")
    assert job.output("text") is None and output_filename(image) == "image.png"
    assert job.stages[0].outputs["image"].key == "jobs/job_1/outputs/image.png"
    assert job.metrics.total_time_s is None and job.urls.events == f"{API}/v1/jobs/job_1/events"


def test_submit_builds_json_or_a_multipart_form(tmp_path: Path) -> None:
    clock = Clock()
    plain = Submission("text-to-image", {"size": 3}, timeout=30, clock=clock, prompt="a fox",
                       params={"dit": {"seed": 7}}, webhook="https://hooks.example/x",
                       webhook_events_filter=("completed",), wait=1.5, idempotency_key="k-1", cancel_after="300")
    assert (plain.call.method, plain.call.url, plain.call.timeout) == ("POST", "/v1/jobs", 31.5)
    assert plain.call.json == {"pipeline": "text-to-image", "input": {"size": 3, "prompt": "a fox"},
                               "params": {"dit": {"seed": 7}}, "webhook": "https://hooks.example/x",
                               "webhook_events_filter": ["completed"]}
    assert plain.call.headers == {"Prefer": "wait=1.5", "Idempotency-Key": "k-1", "Cancel-After": "300"}

    photo = tmp_path / "photo.png"
    photo.write_bytes(b"\x89PNG")
    upload = Submission("image-to-image", timeout=30, prompt="blue", wait=20, files={"image": photo, "mask": b"m"})
    assert upload.call.url == "/v1/jobs/multipart" and upload.call.headers == {"Prefer": "wait=20"}
    assert upload.call.data == {"pipeline": "image-to-image", "input": json.dumps({"prompt": "blue"})}
    assert upload.call.files == {"input.image": ("photo.png", b"\x89PNG"), "input.mask": ("mask", b"m")}


def test_audio_and_video_files_go_as_parts_like_images(tmp_path: Path) -> None:
    from omni_jobs.cli.jobs import parse_inputs

    speech, clip = tmp_path / "speech.wav", tmp_path / "clip.mp4"
    speech.write_bytes(b"RIFF....WAVE")
    clip.write_bytes(b"....ftypisom")
    # The CLI's --input audio=@speech.wav, and a bare path of an existing file.
    inputs, files = parse_inputs([f"audio=@{speech}", f"video={clip}", "prompt=what is said?"])
    assert inputs == {"prompt": "what is said?"} and files == {"audio": speech, "video": clip}
    upload = Submission("omni-understanding", inputs, timeout=30, files=files)
    assert upload.call.url == "/v1/jobs/multipart"
    assert upload.call.files == {"input.audio": ("speech.wav", b"RIFF....WAVE"), "input.video": ("clip.mp4", b"....ftypisom")}


def test_submit_polls_for_what_is_left_of_its_wait(tmp_path: Path) -> None:
    clock = Clock()
    submission = Submission("text-to-image", timeout=30, clock=clock, wait=10)
    clock.now += 4  # the server held the answer 4 s
    running = JobView.model_validate(job_json(tmp_path, JobStatus.running))
    assert submission.left(running) == 6
    assert submission.left(JobView.model_validate(job_json(tmp_path))) is None  # it ended
    clock.now += 7
    assert submission.left(running) is None  # the wait is spent
    assert Submission("text-to-image", timeout=30).left(running) is None  # none was asked


def test_poll_sleeps_longer_each_time_up_to_two_seconds_and_the_deadline(tmp_path: Path) -> None:
    clock = Clock()
    running = JobView.model_validate(job_json(tmp_path, JobStatus.running))
    poll = Poll("job_1", timeout=5, poll_s=0.8, clock=clock)
    delays: list[float] = []
    while (delay := poll.after(running)) is not None and len(delays) < 10:
        delays.append(delay)
        clock.now += delay
        if clock.now >= 104.9:
            break
    assert delays == [0.8, pytest.approx(1.2), pytest.approx(1.8), pytest.approx(1.2)]  # 2.0, cut by the deadline
    clock.now = 105.0
    with pytest.raises(TimeoutError, match=r"job job_1 still running after 5s"):
        poll.after(running)
    quiet = Poll("job_1", timeout=0, raise_on_timeout=False, clock=clock)
    assert quiet.after(running) is None and poll.after(JobView.model_validate(job_json(tmp_path))) is None


def test_pages_follow_the_cursor_until_the_last_page(tmp_path: Path) -> None:
    pages = Pages(status="succeeded", page_size=1)
    first = pages.next_call()
    assert first is not None and first.params == {"limit": 1, "status": "succeeded"}
    one = job_json(tmp_path)
    assert [j.id for j in pages.read(httpx.Response(200, json={"data": [one], "next_cursor": "c2"}))] == ["job_1"]
    second = pages.next_call()
    assert second is not None and second.params == {"limit": 1, "cursor": "c2", "status": "succeeded"}
    assert pages.read(httpx.Response(200, json={"data": [], "next_cursor": None})) == []
    assert pages.next_call() is None


def test_the_key_goes_to_the_api_only(tmp_path: Path) -> None:
    http = httpx.Client(base_url=API, headers=client_headers("ok_secret", {"x-trace": "1"}), timeout=7)
    own = get_call("job/../1").build(http)
    assert str(own.url) == f"{API}/v1/jobs/job%2F..%2F1" and own.headers["authorization"] == "Bearer ok_secret"
    assert own.headers["x-trace"] == "1" and own.extensions["timeout"]["read"] == 7
    image = JobView.model_validate(job_json(tmp_path)).outputs[0]
    assert not download_call(image, API).anonymous
    for url in ("https://bucket.s3.example/jobs/job_1/image.png?X-Amz-Signature=abc",
                "http://api.test:8000@evil.example/v1/jobs/job_1/outputs/image",  # starts with the API URL
                "http://api.test:9000/v1/jobs/job_1/outputs/image"):
        call = download_call(image.model_copy(update={"url": url}), API)
        request = call.build(http)
        assert call.anonymous and "authorization" not in request.headers and "x-trace" not in request.headers
        assert str(request.url) == url and request.extensions["timeout"]["read"] == 7
    http.close()


def test_the_client_imports_without_the_storage_layer() -> None:
    code = ("import sys, omni_jobs.client; "
            "print(sorted(m for m in ('boto3', 'botocore', 'redis', 'numpy', 'PIL', 'fastapi', 'celery', "
            "'omni_jobs.artifacts.store', 'omni_jobs.jobs.store', 'omni_jobs.jobs.redis_store') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_an_audio_format_download_goes_to_the_api_route(tmp_path: Path) -> None:
    from omni_jobs.client.protocol import AUDIO_EXTENSIONS, output_filename
    from omni_jobs.media.audio_formats import AUDIO_FORMATS

    assert tuple(AUDIO_EXTENSIONS) == AUDIO_FORMATS  # the client's copy of the API's formats
    http = httpx.Client(base_url=API, headers=client_headers("ok_secret", {}), timeout=7)
    image = JobView.model_validate(job_json(tmp_path)).outputs[0]
    audio = image.model_copy(update={"name": "audio", "type": "audio", "media_type": "audio/wav",
                                     "url": "https://bucket.s3.example/jobs/job_1/audio.wav?X-Amz-Signature=abc"})
    call = download_call(audio, API, audio_format="mp3", job_id="job_1")
    request = call.build(http)
    assert not call.anonymous and request.headers["authorization"] == "Bearer ok_secret"
    assert str(request.url) == f"{API}/v1/jobs/job_1/outputs/audio?format=mp3"
    with pytest.raises(ValueError, match="audio_format needs the API's download route"):
        download_call(audio, API, audio_format="mp3")  # a presigned URL, and no job id to build the route from
    assert output_filename(audio, "flac") == "audio.flac" and output_filename(image, "flac") == "image.png"
    http.close()
