"""The preview projection and encoding, the MP4 writer, the video payload, and previews through the
progress writer (in-memory store, real ledger): values, sizes and bytes, no services."""

from __future__ import annotations

import base64
import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from omni_jobs.artifacts.codecs import CodecError
from omni_jobs.artifacts.mp4 import decode_mp4, encode_mp4, mp4_info
from omni_jobs.dispatch.cancellation import cancel_job
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.models import EventType
from omni_jobs.media.payloads import FORMATS, VideoClip, decode_payload, encode_payload
from omni_jobs.media.previews import (
    LatentPreview,
    LatentProjection,
    decode_preview,
    one_frame,
    preview_size,
    spatial_latents,
)
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.pipelines.spec import PipelineSpec
from omni_jobs.run.progress_writer import ProgressWriter
from tests.unit.test_progress_writer import SlowStore, running

# RGB = the first three channels, shifted by 0.5: easy to predict.
PROJECTION = LatentProjection(weight=np.eye(4, 3, dtype=np.float32), bias=np.full(3, 0.5, dtype=np.float32))


def smooth_frames(n: int = 9, height: int = 32, width: int = 48) -> np.ndarray:
    t, y, x = np.mgrid[0:n, 0:height, 0:width]
    return np.stack([x / width, y / height, (t / n + x / width) / 2], axis=-1).astype(np.float32)


# --- projection and preview ---
def test_projection_maps_each_latent_pixel_to_clipped_rgb() -> None:
    latents = np.zeros((4, 2, 2), np.float32)
    latents[0, 0, 0], latents[1, 0, 1], latents[2, 1, 0], latents[3, 1, 1] = 0.25, -0.25, 2.0, 9.0
    rgb = PROJECTION.to_rgb(latents)
    assert rgb.dtype == np.uint8 and rgb.shape == (2, 2, 3)
    assert rgb[0, 0].tolist() == [191, 128, 128]  # 0.75, 0.5, 0.5
    assert rgb[0, 1].tolist() == [128, 64, 128]
    assert rgb[1, 0].tolist() == [128, 128, 255]  # clipped at 1
    assert rgb[1, 1].tolist() == [128, 128, 128]  # channel 3 does not count
    with pytest.raises(ValueError, match=r"\[4, h, w\]"):
        PROJECTION.to_rgb(np.zeros((3, 2, 2), np.float32))


@pytest.mark.parametrize(("size", "expected"), [((32, 32), (32, 32)), ((48, 32), (48, 32)),
                                                ((1024, 1024), (256, 256)), ((1280, 720), (256, 144))])
def test_preview_size_keeps_the_aspect_ratio_within_256(size: tuple[int, int], expected: tuple[int, int]) -> None:
    assert preview_size(*size) == expected


def test_preview_event_data_is_a_decodable_jpeg_of_the_output_aspect() -> None:
    latents = np.random.default_rng(0).normal(size=(4, 8, 12)).astype(np.float32)
    preview = LatentPreview(latents, PROJECTION, step=5, total=20, width=96, height=64)
    data = preview.event_data("dit")
    assert {k: data[k] for k in ("stage", "step", "total", "media_type", "width", "height")} == {
        "stage": "dit", "step": 5, "total": 20, "media_type": "image/jpeg", "width": 96, "height": 64}
    image = decode_preview(data)
    assert image.format == "JPEG" and image.size == (96, 64) and image.mode == "RGB"
    # the picture is the projection, upscaled: its mean colour survives JPEG within a few levels
    expected = PROJECTION.to_rgb(latents).reshape(-1, 3).mean(axis=0)
    assert np.abs(np.asarray(image, float).reshape(-1, 3).mean(axis=0) - expected).max() < 6
    assert len(base64.b64decode(data["data"])) < 4000  # small: it travels in an SSE event


def test_one_frame_takes_a_video_latents_middle_frame_and_spatial_latents_unpacks() -> None:
    video = torch.arange(2 * 5 * 3 * 4, dtype=torch.float32).reshape(2, 5, 3, 4)
    assert np.array_equal(one_frame(video), video[:, 2].numpy())
    image = torch.ones(4, 3, 4, dtype=torch.float64)
    frame = one_frame(image)
    assert frame.dtype == np.float32 and frame.shape == (4, 3, 4)

    class Packed:  # what a Flux-style pipeline offers: 2x2 patches packed into a sequence
        vae_scale_factor = 8

        @staticmethod
        def _unpack_latents(latents: torch.Tensor, height: int, width: int, factor: int) -> torch.Tensor:
            b, _, c = latents.shape
            h, w = height // factor, width // factor
            return latents.view(b, h // 2, w // 2, c // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c // 4, h, w)

    packed = torch.zeros(1, 4, 16)
    assert spatial_latents(Packed(), packed, 32, 32).shape == (1, 4, 4, 4)
    assert spatial_latents(object(), image[None], 24, 32) is not None
    with pytest.raises(ValueError, match="cannot unpack"):
        spatial_latents(object(), packed, 32, 32)


# --- MP4 ---
def test_mp4_round_trip_keeps_the_pictures_and_its_header_says_frames_fps_and_size() -> None:
    frames = smooth_frames()
    data = encode_mp4(frames, 16)
    again, _ = decode_mp4(encode_mp4(frames, 16))  # same frames, same pictures (not always the same bytes)
    assert data[4:8] == b"ftyp"
    assert mp4_info(data) == {"frames": 9, "fps": 16.0, "duration_s": 9 / 16, "width": 48, "height": 32}
    decoded, fps = decode_mp4(data)
    assert decoded.shape == (9, 32, 48, 3) and decoded.dtype == np.uint8 and fps == 16.0
    assert np.abs(decoded.astype(float) - np.round(frames * 255)).mean() < 3  # H.264, near lossless here
    assert np.abs(decoded.astype(int) - again.astype(int)).mean() < 1


def test_mp4_takes_uint8_arrays_and_pil_frames_alike() -> None:
    frames = np.round(smooth_frames(3) * 255).astype(np.uint8)
    as_pil = [Image.fromarray(f) for f in frames]
    from_arrays, _ = decode_mp4(encode_mp4(frames, 8))
    from_pil, _ = decode_mp4(encode_mp4(as_pil, 8))
    assert np.abs(from_arrays.astype(int) - from_pil.astype(int)).mean() < 1
    assert mp4_info(encode_mp4(frames, 29.97))["fps"] == pytest.approx(29.97, abs=1e-3)


@pytest.mark.parametrize(("frames", "fps", "fragment"), [
    (np.zeros((2, 32, 32), np.float32), 8, "[n, height, width, 3]"),
    (np.zeros((2, 31, 32, 3), np.float32), 8, "even sides"),
    (np.full((1, 32, 32, 3), np.nan, np.float32), 8, "NaN"),
    (np.zeros((1, 32, 32, 3), np.float32), 0, "fps must be positive"),
])
def test_mp4_refuses_what_it_cannot_encode(frames: np.ndarray, fps: float, fragment: str) -> None:
    with pytest.raises(CodecError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        encode_mp4(frames, fps)


def test_mp4_reader_refuses_other_bytes() -> None:
    with pytest.raises(CodecError):
        mp4_info(b"not a video at all")
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="PNG")
    with pytest.raises(CodecError):
        decode_mp4(buf.getvalue())


def test_video_payload_is_an_mp4() -> None:
    assert (FORMATS["video"].extension, FORMATS["video"].media_type) == ("mp4", "video/mp4")
    clip = VideoClip(smooth_frames(5), 10.0)
    assert (clip.num_frames, clip.duration_s) == (5, 0.5)
    data = encode_payload("video", clip)
    back = decode_payload("video", data)
    assert isinstance(back, VideoClip) and back.frames.shape == (5, 32, 48, 3) and back.fps == 10.0
    with pytest.raises(TypeError, match="VideoClip"):
        encode_payload("video", clip.frames)


# --- the parameters ---
def test_preview_every_is_a_stage_default_a_job_overrides() -> None:
    spec = load_catalogue().get("text-to-image").model_dump(by_alias=True)
    spec["stages"][1]["defaults"]["preview_every"] = 5
    stage = PipelineSpec.model_validate(spec).stage("dit")
    assert stage.params(stage.defaults).preview_every == 5  # type: ignore[attr-defined]
    assert stage.params({**stage.defaults, "preview_every": 0}).preview_every == 0  # type: ignore[attr-defined]
    spec["stages"][1]["defaults"]["preview_every"] = -1
    with pytest.raises(ValueError, match="defaults.preview_every"):
        PipelineSpec.model_validate(spec)
    video = load_catalogue().get("text-to-video").stage("video")
    assert video.params({}).preview_every == 0  # type: ignore[attr-defined]


# --- previews through the progress writer ---
def preview_events(ledger: JobLedger, job_id: str) -> list[dict[str, object]]:
    return [e.data for e in ledger.events(job_id) if e.type is EventType.output_preview]


def test_previews_are_made_off_the_callers_thread_newest_wins_and_drain_waits() -> None:
    ledger = JobLedger(SlowStore())
    store = ledger.store
    assert isinstance(store, SlowStore)
    job, lease = running(ledger, "ar")
    writer = ProgressWriter(ledger)
    writer.begin(lease)
    made_on: list[str] = []

    def maker(step: int) -> object:
        def make() -> dict[str, object]:
            made_on.append(threading.current_thread().name)
            return {"stage": "ar", "step": step}
        return make

    store.gate.clear()
    writer.preview(lease, job, maker(1))  # type: ignore[arg-type]
    assert store.held.wait(5)
    for step in (2, 3, 4):
        writer.preview(lease, job, maker(step))  # type: ignore[arg-type]
    assert not writer.drain(lease, timeout_s=0.2)  # held by the store
    store.gate.set()
    assert writer.drain(lease)
    assert [e["step"] for e in preview_events(ledger, job.id)] == [1, 4]
    assert set(made_on) == {"omni-progress-writer"}


def test_a_refused_preview_stops_the_stage_and_a_failing_one_is_skipped() -> None:
    ledger = JobLedger(MemoryJobStore())
    job, lease = running(ledger, "ar")
    writer = ProgressWriter(ledger, background=False)
    writer.begin(lease)

    def broken() -> dict[str, object]:
        raise RuntimeError("cannot encode")

    writer.preview(lease, job, broken)  # logged, skipped: a preview never fails a stage
    assert writer.stopped(lease) is None and preview_events(ledger, job.id) == []
    cancel_job(ledger, job.id)
    writer.preview(lease, job, lambda: {"stage": "ar", "step": 1})
    assert writer.stopped(lease) == "canceled" and preview_events(ledger, job.id) == []
