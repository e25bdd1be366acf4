"""File inputs (image, audio, video): every accepted form, every refusal with its message, how they are
stored and how a stage loads them; a bad file is refused before any job exists."""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from omni_jobs.accept.submission import JobSubmitter
from omni_jobs.artifacts import ArtifactRef, ArtifactStore, LocalBackend, codecs, mp4
from omni_jobs.core.errors import InvalidRequest
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.models import Job, JobOutput, StageRecord
from omni_jobs.media.input_files import (
    ArtifactReference,
    FileUpload,
    ImageUpload,
    InputFiles,
    OutputReference,
    load_input_file,
    load_input_image,
    normalize_audio,
    normalize_image,
    parse_file_value,
    parse_image_value,
)
from omni_jobs.media.payloads import AudioClip, VideoClip
from omni_jobs.pipelines.catalogue import PipelineCatalogue, load_catalogue
from omni_jobs.pipelines.limits import Limits
from omni_jobs.pipelines.spec import InputField, PipelineSpec
from tests import media_files as mf

FIELD = InputField(type="image", max_bytes=50_000)


def image_bytes(fmt: str = "PNG", mode: str = "RGB", size: tuple[int, int] = (20, 12)) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color=(10, 200, 30, 128)[: len(mode)] if mode != "L" else 99).save(buffer, format=fmt)
    return buffer.getvalue()


PNG = image_bytes()
B64 = base64.b64encode(PNG).decode()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (PNG, ImageUpload(PNG)),
        ("data:image/png;base64," + B64, ImageUpload(PNG)),
        (B64, ImageUpload(PNG)),
        ({"data": B64}, ImageUpload(PNG)),
        ("http://api:8000/v1/jobs/job_abc123/outputs/image", OutputReference("job_abc123", "image")),
        ({"url": "/v1/jobs/job_abc123/outputs/image?x=1"}, OutputReference("job_abc123", "image")),
        ({"job_id": "job_1", "output": "img"}, OutputReference("job_1", "img")),
    ],
)
def test_accepted_forms(value: Any, expected: Any) -> None:
    assert parse_image_value(value, FIELD) == expected


def test_artifact_reference() -> None:
    ref = {"backend": "local", "key": "jobs/job_1/outputs/image.png", "media_type": "image/png", "size": 3,
           "sha256": "0" * 64}
    source = parse_image_value({"artifact": ref}, FIELD)
    assert isinstance(source, ArtifactReference) and source.ref.key == ref["key"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("data:image/png,rawbytes", "without ';base64,'"),
        ("data:text/plain;base64,aGk=", "is a data: URI of text/plain, not an image"),
        ("not base64 at all!", "is not valid base64"),
        ("https://example.com/cat.png", "nothing is fetched from elsewhere"),
        ({"path": "/etc/passwd"}, "is an object with keys ['path']"),
        ({"artifact": {"key": ""}}, "has an invalid artifact ref"),
        (b"", "is empty"),
        (b"x" * 50_001, "is 50001 bytes; at most 50000"),
        (3.5, "must be an image"),
    ],
)
def test_refused_forms(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        parse_image_value(value, FIELD)
    assert message in str(info.value)


@pytest.mark.parametrize(("fmt", "mode"), [("PNG", "RGBA"), ("JPEG", "RGB"), ("WEBP", "RGB"), ("PNG", "L"), ("GIF", "P")])
def test_normalize_any_format_to_rgb_png(fmt: str, mode: str) -> None:
    png, width, height = normalize_image(image_bytes(fmt, mode))
    image = codecs.decode_png(png)
    assert (image.mode, image.size, width, height) == ("RGB", (20, 12), 20, 12)
    assert normalize_image(image_bytes(fmt, mode))[0] == png  # same pixels, same bytes


def test_normalize_refuses_garbage_and_huge_images(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="not an image PIL can read"):
        normalize_image(b"\x89PNG\r\n\x1a\n truncated")
    from omni_jobs.media import input_files
    monkeypatch.setattr(input_files, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ValueError, match="is 20x12 pixels; at most 100 pixels"):
        normalize_image(PNG)


def test_prepare_store_and_load(tmp_path: Path) -> None:
    artifacts = ArtifactStore(LocalBackend(tmp_path))
    jobs = MemoryJobStore()
    spec = load_catalogue().get("image-to-image")
    files = InputFiles(artifacts, jobs)

    # An output of an earlier job, referenced by id and output name.
    earlier = artifacts.put_output("jobs/job_old/outputs/image.png", PNG, codecs.MEDIA_PNG)
    job = Job(id="job_old", pipeline="text-to-image", input={}, stages=[StageRecord(id="dit", engine="dit", queue="dit")],
              outputs=[JobOutput(name="image", type="image", media_type="image/png", size=earlier.size,
                                 artifact=earlier)])
    JobLedger(jobs).submit(job, [])
    prepared = files.prepare(spec, {"prompt": "x", "image": {"job_id": "job_old", "output": "image"}})
    records = files.store("job_new", prepared)
    record = records["image"]
    assert record["artifact"]["key"] == "jobs/job_new/inputs/image.png"
    assert (record["width"], record["height"], record["media_type"]) == (20, 12, "image/png")
    assert load_input_image(artifacts, record).size == (20, 12)

    with pytest.raises(InvalidRequest) as info:
        files.prepare(spec, {"prompt": "x", "image": {"job_id": "job_old", "output": "text"}})
    assert info.value.errors[0].loc == ("input", "image")
    assert "names output 'text' of job 'job_old', which has outputs ['image']" in info.value.errors[0].message
    with pytest.raises(InvalidRequest, match="names job 'job_gone', which does not exist"):
        files.prepare(spec, {"prompt": "x", "image": {"job_id": "job_gone", "output": "image"}})
    outside = {"backend": "local", "key": "elsewhere/x.png", "media_type": "image/png", "size": 1, "sha256": "0" * 64}
    with pytest.raises(InvalidRequest, match="which is not a job's artifact"):
        files.prepare(spec, {"prompt": "x", "image": {"artifact": outside}})


# --- audio and video ---
AUDIO_FIELD = InputField(type="audio", required=False)
VIDEO_FIELD = InputField(type="video", required=False)
MEDIA = PipelineSpec.model_validate(mf.MEDIA_PIPELINE)
WAV = mf.wav(0.5)


@pytest.mark.parametrize(
    ("value", "field", "expected"),
    [
        ("data:audio/wav;base64," + base64.b64encode(WAV).decode(), AUDIO_FIELD, FileUpload(WAV)),
        ("data:audio/mpeg;base64,AAAA", AUDIO_FIELD, FileUpload(b"\0\0\0")),
        ("data:application/ogg;base64,AAAA", AUDIO_FIELD, FileUpload(b"\0\0\0")),
        ("data:video/mp4;base64,AAAA", VIDEO_FIELD, FileUpload(b"\0\0\0")),
        ({"data": "AAAA"}, VIDEO_FIELD, FileUpload(b"\0\0\0")),
        (WAV, AUDIO_FIELD, FileUpload(WAV)),
        ("http://api:8000/v1/jobs/job_abc123/outputs/audio", AUDIO_FIELD, OutputReference("job_abc123", "audio")),
        ({"job_id": "job_1", "output": "video"}, VIDEO_FIELD, OutputReference("job_1", "video")),
    ],
)
def test_audio_and_video_take_the_same_forms(value: Any, field: InputField, expected: Any) -> None:
    assert parse_file_value(value, field) == expected


@pytest.mark.parametrize(
    ("value", "field", "message"),
    [
        ("data:image/png;base64,AAAA", AUDIO_FIELD, "is a data: URI of image/png, not audio (audio/* or application/ogg)"),
        ("data:audio/wav;base64,AAAA", VIDEO_FIELD, "is a data: URI of audio/wav, not a video (video/*)"),
        ("data:video/mp4,raw", VIDEO_FIELD, "send data:video/mp4;base64,<data>"),
        (b"", AUDIO_FIELD, "is empty"),
        (b"x" * (25 * 2**20 + 1), AUDIO_FIELD, "at most 26214400"),
        (b"x" * 1_000_001, MEDIA.inputs["clip"], "is 1000001 bytes; at most 1000000"),  # the field's own max_bytes
        (7, AUDIO_FIELD, "must be audio"),
        (7, VIDEO_FIELD, "must be a video"),
    ],
)
def test_audio_and_video_forms_refused(value: Any, field: InputField, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_file_value(value, field)
    assert message in str(info.value)


def test_field_byte_limits_per_type() -> None:
    assert [InputField(type=t).byte_limit for t in ("image", "audio", "video", "text")] == [16 * 2**20, 25 * 2**20,
                                                                                            64 * 2**20, 0]
    with pytest.raises(ValueError, match=r"max_bytes applies to file inputs \(image, audio, video\), not text"):
        InputField(type="text", max_bytes=3)
    with pytest.raises(ValueError, match="an audio input cannot have a default"):
        InputField(type="audio", default="x")
    assert MEDIA.file_inputs() == ["speech", "clip"]


@pytest.mark.parametrize("name", sorted(mf.AUDIO_FORMATS))
def test_audio_is_stored_as_a_wav_at_its_own_rate_and_loaded_as_a_clip(tmp_path: Path, name: str) -> None:
    artifacts = ArtifactStore(LocalBackend(tmp_path))
    files = InputFiles(artifacts, MemoryJobStore())
    prepared = files.prepare(MEDIA, {"prompt": "x", "speech": mf.encode_audio(name, 1.0)})
    record = files.store("job_new", prepared)["speech"]
    rate, channels = (48_000 if name == "opus" else 16_000), (2 if name == "ogg" else 1)
    assert record["artifact"]["key"] == "jobs/job_new/inputs/speech.wav"
    assert (record["media_type"], record["sample_rate"], record["channels"]) == ("audio/wav", rate, channels)
    assert 0.95 <= record["duration_s"] <= 1.1 and record["size"] == record["artifact"]["size"]
    assert codecs.wav_info(artifacts.get(ArtifactRef.model_validate(record["artifact"])))["sample_rate"] == rate
    clip = load_input_file(artifacts, "audio", record)
    assert isinstance(clip, AudioClip) and clip.sample_rate == rate and clip.samples.shape[0] == channels
    assert clip.samples.dtype == np.float32 and clip.duration_s == pytest.approx(record["duration_s"], abs=1e-4)


def test_16_bit_pcm_comes_back_sample_for_sample() -> None:
    stereo = codecs.encode_wav(np.clip(np.random.default_rng(0).normal(0, 0.6, (2, 4000)), -1, 1), 22_050)
    assert normalize_audio(stereo).data == stereo  # a 16-bit WAV: stored as the same bytes
    assert normalize_audio(mf.encode_audio("flac", 0.5)).data == mf.wav(0.5)  # FLAC: the WAV it was made from


def test_video_is_stored_as_h264_mp4_copied_or_reencoded(tmp_path: Path) -> None:
    artifacts = ArtifactStore(LocalBackend(tmp_path))
    files = InputFiles(artifacts, MemoryJobStore())
    h264 = mf.mp4(frames=12, height=32, width=48, fps=12.0)
    records = files.store("job_v", files.prepare(MEDIA, {"prompt": "x", "clip": h264}))
    record = records["clip"]
    assert record["artifact"]["key"] == "jobs/job_v/inputs/clip.mp4" and record["media_type"] == "video/mp4"
    assert {k: record[k] for k in ("frames", "fps", "width", "height", "duration_s")} == {
        "frames": 12, "fps": 12.0, "width": 48, "height": 32, "duration_s": 1.0}
    clip = load_input_file(artifacts, "video", record)
    assert isinstance(clip, VideoClip) and clip.frames.shape == (12, 32, 48, 3) and clip.fps == 12.0
    np.testing.assert_array_equal(clip.frames, mp4.decode_mp4(h264)[0])  # H.264 already: the very frames (copied)

    # VP9 in WebM with odd sides: re-encoded as H.264, cropped to even sides.
    record = files.store("job_w", files.prepare(MEDIA, {"prompt": "x", "clip": mf.webm(6, 31, 47, 10.0)}))["clip"]
    assert (record["frames"], record["width"], record["height"], record["fps"]) == (6, 46, 30, 10.0)
    stored = artifacts.get(ArtifactRef.model_validate(record["artifact"]))
    assert mp4.mp4_info(stored)["frames"] == 6
    frames = load_input_file(artifacts, "video", record)
    assert isinstance(frames, VideoClip) and frames.frames.shape == (6, 30, 46, 3)
    with pytest.raises(ValueError, match="input type 'text' is not a file"):
        load_input_file(artifacts, "text", record)


BAD_AUDIO = [
    (mf.encode_audio("mp3", 2.0)[:1200], "truncated"),
    (mf.wav(7200, rate=400), "is 7,200 s long (as its header says); at most 600 s (OMNI_MAX_AUDIO_SECONDS)"),
    (mf.lying_wav(10.0, 0.5), "is truncated or damaged: its header says 10 s, but only 0.5 s decode"),
    (mf.lying_wav(100_000.0, 0.5), "is 100,000 s long (as its header says); at most 600 s"),
    (b"", "is empty"),
    (b"Dear diary, today I recorded nothing.\n" * 30, "is not audio FFmpeg can read"),
    (mf.mp4(), "has no audio stream"),
]
BAD_VIDEO = [
    (mf.audio_only_mp4(), "has no video stream (mov file holding audio)"),
    (mf.zip_file(), "is not video FFmpeg can read"),
    (b"", "is empty"),
    (mf.wav(), "is not in a format taken as video"),
]


@pytest.mark.parametrize(("data", "message"), BAD_AUDIO,
                         ids=["truncated-mp3", "2-hour-wav", "lying-wav", "lying-wav-past-limit", "empty", "text", "mp4"])
def test_bad_audio_is_a_422_naming_the_field_and_no_job_is_made(tmp_path: Path, data: bytes, message: str) -> None:
    refused(tmp_path, {"prompt": "x", "speech": data}, "speech", "invalid_audio", message)


@pytest.mark.parametrize(("data", "message"), BAD_VIDEO, ids=["audio-only-mp4", "zip-renamed-mp4", "empty", "wav"])
def test_bad_video_is_a_422_naming_the_field_and_no_job_is_made(tmp_path: Path, data: bytes, message: str) -> None:
    refused(tmp_path, {"prompt": "x", "clip": data}, "clip", "invalid_video", message)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (Limits(max_video_frames=10), "has 12 frames (as its header says); at most 10 (OMNI_MAX_VIDEO_FRAMES)"),
        (Limits(max_video_pixels=40 * 30),
         "has 48x32 frames (1,536 pixels); at most 1,200 pixels a frame (OMNI_MAX_VIDEO_PIXELS)"),
        (Limits(max_video_seconds=0.5), "is 1 s long (as its header says); at most 0.5 s (OMNI_MAX_VIDEO_SECONDS)"),
        (Limits(max_video_bytes=1000), "bytes; this server takes at most 1000 (OMNI_MAX_VIDEO_BYTES)"),
    ],
)
def test_video_over_a_limit_is_refused(tmp_path: Path, limits: Limits, message: str) -> None:
    refused(tmp_path, {"prompt": "x", "clip": mf.mp4(frames=12, fps=12.0)}, "clip", "invalid_video", message, limits)


def test_audio_limits_are_this_servers(tmp_path: Path) -> None:
    refused(tmp_path, {"prompt": "x", "speech": mf.wav(2.0)}, "speech", "invalid_audio",
            "is 2 s long (as its header says); at most 1 s (OMNI_MAX_AUDIO_SECONDS)", Limits(max_audio_seconds=1))
    refused(tmp_path, {"prompt": "x", "speech": mf.wav(2.0)}, "speech", "invalid_audio",
            "this server takes at most 100 (OMNI_MAX_AUDIO_BYTES)", Limits(max_audio_bytes=100))


def refused(tmp_path: Path, input_: dict[str, Any], field: str, kind: str, message: str,
            limits: Limits | None = None) -> None:
    """A submit of ``input_`` is an InvalidRequest naming ``field``, and leaves no job and no stored file."""
    store = MemoryJobStore()
    artifacts = ArtifactStore(LocalBackend(tmp_path))
    submitter = JobSubmitter(JobLedger(store), PipelineCatalogue([MEDIA]), artifacts=artifacts, limits=limits)
    with pytest.raises(InvalidRequest) as info:
        submitter.submit("media-inputs", input_)
    errors = [(e.loc, e.type) for e in info.value.errors]
    assert errors == [(("input", field), kind)], info.value.errors
    assert message in info.value.errors[0].message
    assert not store.job_ids_created(after=None, until=time.time() + 60) and not any(tmp_path.rglob("*.*"))


def test_outputs_of_another_type_are_refused_by_name(tmp_path: Path) -> None:
    artifacts = ArtifactStore(LocalBackend(tmp_path))
    jobs = MemoryJobStore()
    image = artifacts.put_output("jobs/job_img/outputs/image.png", PNG, codecs.MEDIA_PNG)
    sound = artifacts.put_output("jobs/job_img/outputs/audio.wav", WAV, codecs.MEDIA_WAV)
    JobLedger(jobs).submit(Job(id="job_img", pipeline="p", input={}, stages=[], outputs=[
        JobOutput(name="image", type="image", media_type="image/png", size=image.size, artifact=image),
        JobOutput(name="audio", type="audio", media_type="audio/wav", size=sound.size, artifact=sound)]), [])
    files = InputFiles(artifacts, jobs)
    with pytest.raises(InvalidRequest, match=r"names output 'image' of job 'job_img', which is image \(image/png\), "
                                             "not audio"):
        files.prepare(MEDIA, {"prompt": "x", "speech": {"job_id": "job_img", "output": "image"}})
    # A WAV another job made, by its output URL: stored again as this job's input.
    record = files.store("job_next", files.prepare(MEDIA, {"prompt": "x", "speech":
                                                           "http://x/v1/jobs/job_img/outputs/audio"}))["speech"]
    assert record["artifact"]["sha256"] == sound.sha256  # the same 16-bit WAV, the same bytes
