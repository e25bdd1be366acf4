"""Image inputs: every accepted form, every refusal with its message, and how they are stored."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from omni_jobs.artifacts import ArtifactStore, LocalBackend, codecs
from omni_jobs.errors import InvalidRequest
from omni_jobs.input_files import (
    ArtifactReference,
    ImageUpload,
    InputFiles,
    OutputReference,
    load_input_image,
    normalize_image,
    parse_image_value,
)
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.models import Job, JobOutput, StageRecord
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.pipelines.spec import InputField

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
    from omni_jobs import input_files

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
