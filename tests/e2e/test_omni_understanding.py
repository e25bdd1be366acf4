"""Omni understanding end to end: images, audio and video through the HTTP API into vLLM stages.

Each medium is shown to reach the model by a value the model's own processor makes: the prompt's
token count (vLLM expands each placeholder into the item's tokens) grows with the image's size, the
clip's length and the video's frames. The transcription's duration is the clip's. A chain runs a
vision-language model's text into a DiT.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import numpy as np
from PIL import Image

from omni_jobs.artifacts import ArtifactRef, ArtifactStore, codecs
from tests.e2e import test_omni_pipelines
from tests.e2e.test_omni_pipelines import by_name, download, run_queued
from tests.media_files import mp4, wav

system_artifacts = test_omni_pipelines.system_artifacts  # the system's artifact store (a module fixture)


def _data_uri(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def _png(width: int, height: int) -> bytes:
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x * y) % 256], axis=-1).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def _stage_text(job: dict[str, Any], stage: str, artifacts: ArtifactStore) -> dict[str, Any]:
    """The document a stage wrote beside its text: finish_reason and usage (what vLLM reported)."""
    record = next(s for s in job["stages"] if s["id"] == stage)
    document = codecs.decode_json(artifacts.get(ArtifactRef.model_validate(record["outputs"]["text"])))
    assert isinstance(document, dict)
    return document


def _prompt_tokens(api: httpx.Client, artifacts: ArtifactStore, pipeline: str, stage: str,
                   inputs: dict[str, Any]) -> int:
    job = run_queued(api, pipeline, inputs, {stage: {"max_tokens": 2}})
    tokens = _stage_text(job, stage, artifacts)["usage"]["prompt_tokens"]
    assert isinstance(tokens, int)
    return tokens


def test_an_image_reaches_the_vision_language_model(api: httpx.Client, system_artifacts: ArtifactStore) -> None:
    small = _prompt_tokens(api, system_artifacts, "image-to-text", "vlm",
                           {"image": _data_uri(_png(56, 56), "image/png")})
    large = _prompt_tokens(api, system_artifacts, "image-to-text", "vlm",
                           {"image": _data_uri(_png(112, 112), "image/png")})
    assert large > small  # 4x the pixels: more vision tokens in the prompt


def test_audio_video_and_an_image_reach_the_omni_thinker(api: httpx.Client, system_artifacts: ArtifactStore) -> None:
    def tokens(**media: str) -> int:
        return _prompt_tokens(api, system_artifacts, "omni-understanding", "thinker",
                              {"prompt": "What is in it?", **media})

    text_only = tokens()
    short, long = tokens(audio=_data_uri(wav(1.0), "audio/wav")), tokens(audio=_data_uri(wav(3.0), "audio/wav"))
    assert text_only < short < long  # ~25 audio tokens a second
    few = tokens(video=_data_uri(mp4(frames=8, fps=4.0), "video/mp4"))
    many = tokens(video=_data_uri(mp4(frames=24, fps=4.0), "video/mp4"))
    assert text_only < few < many  # 2 s against 6 s of video, sampled at 2 frames a second
    assert tokens(image=_data_uri(_png(56, 56), "image/png")) > text_only


def test_speech_to_text_transcribes_the_clip(api: httpx.Client, system_artifacts: ArtifactStore) -> None:
    job = run_queued(api, "speech-to-text", {"audio": _data_uri(wav(2.5, rate=22_050), "audio/wav")},
                     {"asr": {"max_tokens": 4}})
    document = _stage_text(job, "asr", system_artifacts)
    assert document["duration"] == 2.5  # resampled to the model's 16 kHz, the same length
    assert document["task"] == "transcribe" and isinstance(document["language"], str)  # detected
    assert [(s["start"], s["end"]) for s in document["segments"]] == [(0.0, 2.5)]
    assert document["usage"]["completion_tokens"] >= 1
    assert by_name(job)["text"]["text"] == document["text"]


def test_understanding_chains_into_generation(api: httpx.Client) -> None:
    job = run_queued(api, "image-to-text-to-image", {"image": _data_uri(_png(64, 48), "image/png")}, {})
    outputs = by_name(job)
    image = Image.open(io.BytesIO(download(outputs["image"]["url"])))
    assert image.size == (64, 64)
    assert [s["id"] for s in job["stages"]] == ["vlm", "dit"]
