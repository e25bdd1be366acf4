"""The results step's output handlers: the file each writes and the manifest entry it describes."""

from __future__ import annotations

import base64
import io
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omni_jobs.artifacts import ArtifactStore, LocalBackend, codecs
from omni_jobs.media.payloads import AudioClip, decode_payload, encode_payload
from omni_jobs.pipelines.modalities import OUTPUT_TYPES
from omni_jobs.report.results import OUTPUT_HANDLERS


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(LocalBackend(tmp_path))


def test_every_output_type_has_a_handler() -> None:
    assert set(OUTPUT_HANDLERS) == set(OUTPUT_TYPES)


def test_text(store: ArtifactStore) -> None:
    entry = OUTPUT_HANDLERS["text"](store, "job_1", "caption", [encode_payload("text", "héllo")])
    assert (entry.type, entry.media_type, entry.text) == ("text", "application/json", "héllo")
    assert entry.artifact.key == "jobs/job_1/outputs/caption.json"
    assert codecs.decode_json(store.get(entry.artifact)) == {"text": "héllo"}


def test_image(store: ArtifactStore) -> None:
    png = encode_payload("image", Image.new("RGB", (40, 24), (1, 2, 3)))
    entry = OUTPUT_HANDLERS["image"](store, "job_1", "image", [png])
    assert (entry.type, entry.media_type, entry.width, entry.height, entry.size) == ("image", "image/png", 40, 24,
                                                                                       len(png))
    assert store.get(entry.artifact) == png


def test_audio(store: ArtifactStore) -> None:
    samples = np.sin(np.linspace(0, 440 * 2 * np.pi, 8000, dtype=np.float32))[None, :] * 0.5
    wav = encode_payload("audio", AudioClip(samples, 16000))
    entry = OUTPUT_HANDLERS["audio"](store, "job_1", "audio", [wav])
    assert (entry.type, entry.media_type, entry.sample_rate, entry.duration_s) == ("audio", "audio/wav", 16000, 0.5)
    assert entry.artifact.key == "jobs/job_1/outputs/audio.wav"
    with wave.open(io.BytesIO(store.get(entry.artifact))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 16000, 8000)
    clip = decode_payload("audio", wav)
    assert clip.samples.shape == (1, 8000) and clip.duration_s == 0.5
    assert np.abs(clip.samples - samples).max() < 1e-4


@pytest.mark.parametrize("modality", ["latents", "hidden_states", "prompt_embeds"])
def test_tensors(store: ArtifactStore, modality: str) -> None:
    tensor = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    data = encode_payload(modality, tensor)  # type: ignore[arg-type]
    entry = OUTPUT_HANDLERS[modality](store, "job_1", "t", [data])
    assert (entry.type, entry.media_type, entry.shape) == (modality, "application/vnd.safetensors", [2, 3, 4])
    assert torch.equal(codecs.decode_tensors(store.get(entry.artifact))[modality], tensor)


def test_text_and_image_bundle(store: ArtifactStore) -> None:
    png = encode_payload("image", Image.new("RGB", (16, 8), (200, 0, 0)))
    entry = OUTPUT_HANDLERS["text+image"](store, "job_1", "answer", [encode_payload("text", "a red box"), png])
    assert (entry.type, entry.media_type, entry.text, entry.width, entry.height) == (
        "text+image", "application/json", "a red box", 16, 8)
    document = codecs.decode_json(store.get(entry.artifact))
    assert document["text"] == "a red box"
    assert document["image"]["media_type"] == "image/png" and base64.b64decode(document["image"]["data"]) == png
