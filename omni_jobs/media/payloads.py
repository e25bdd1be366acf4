"""How each modality is written down when one stage hands it to the next.

One table: modality -> file format. Tensors are safetensors, images PNG, audio WAV (16-bit PCM),
video MP4 (H.264), text JSON; nothing is pickled. Stage code calls encode/decode and never picks a format itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias, overload

import numpy as np

from omni_jobs.artifacts import codecs, mp4
from omni_jobs.core.json_types import JsonValue
from omni_jobs.pipelines.modalities import TENSOR_MODALITIES, Modality

if TYPE_CHECKING:
    import PIL.Image
    import torch


@dataclass(frozen=True)
class PayloadFormat:
    extension: str
    media_type: str


@dataclass(frozen=True)
class AudioClip:
    """A waveform: float samples in [-1, 1] shaped [channels, n], and its sample rate."""

    samples: np.ndarray
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return float(self.samples.shape[-1]) / self.sample_rate


@dataclass(frozen=True)
class VideoClip:
    """Frames shaped [n, height, width, 3] (float in [0, 1] or uint8) and their frame rate."""

    frames: np.ndarray
    fps: float

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps


SAFETENSORS = PayloadFormat("safetensors", "application/vnd.safetensors")
FORMATS: dict[Modality, PayloadFormat] = {
    "text": PayloadFormat("json", "application/json"),
    "token_ids": SAFETENSORS,
    "hidden_states": SAFETENSORS,
    "prompt_embeds": SAFETENSORS,
    "latents": SAFETENSORS,
    "audio_codes": SAFETENSORS,
    "image": PayloadFormat("png", "image/png"),
    "audio": PayloadFormat("wav", "audio/wav"),
    "video": PayloadFormat("mp4", codecs.MEDIA_MP4),
}


Payload: TypeAlias = "str | torch.Tensor | PIL.Image.Image | AudioClip | VideoClip"
"""What a decoded payload is: text, a tensor, an image, an audio clip or a video clip."""
TensorModality = Literal["token_ids", "hidden_states", "prompt_embeds", "latents", "audio_codes"]


def encode_payload(modality: Modality, value: object) -> bytes:
    """text: str, or a mapping with "text" and what describes it (an AR stage's finish_reason and
    usage, kept beside the text); token_ids, audio_codes: list[int] or tensor; tensors: tensor; image: PIL image;
    audio: AudioClip; video: VideoClip. A value of another type is a TypeError."""
    if modality == "text":
        return codecs.encode_json(dict(value) if isinstance(value, Mapping) else {"text": value})
    if modality in TENSOR_MODALITIES:
        import torch

        listed = modality in ("token_ids", "audio_codes")
        if listed and not isinstance(value, torch.Tensor) and isinstance(value, Iterable):
            value = torch.tensor(list(value), dtype=torch.int64)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{modality} payloads are tensors, got {type(value).__name__}")
        return codecs.encode_tensors({modality: value})
    if modality == "image":
        from PIL import Image

        if not isinstance(value, Image.Image):
            raise TypeError(f"image payloads are PIL images, got {type(value).__name__}")
        return codecs.encode_png(value)
    if modality == "audio":
        if not isinstance(value, AudioClip):
            raise TypeError(f"audio payloads are AudioClip(samples, sample_rate), got {type(value).__name__}")
        return codecs.encode_wav(value.samples, value.sample_rate)
    if modality == "video":
        if not isinstance(value, VideoClip):
            raise TypeError(f"video payloads are VideoClip(frames, fps), got {type(value).__name__}")
        return mp4.encode_mp4(value.frames, value.fps)
    raise ValueError(f"no encoder for modality '{modality}'")


@overload
def decode_payload(modality: Literal["text"], data: bytes) -> str: ...
@overload
def decode_payload(modality: TensorModality, data: bytes) -> torch.Tensor: ...
@overload
def decode_payload(modality: Literal["image"], data: bytes) -> PIL.Image.Image: ...
@overload
def decode_payload(modality: Literal["audio"], data: bytes) -> AudioClip: ...
@overload
def decode_payload(modality: Literal["video"], data: bytes) -> VideoClip: ...
@overload
def decode_payload(modality: Modality, data: bytes) -> Payload: ...


def decode_payload(modality: Modality, data: bytes) -> Payload:
    if modality == "text":
        document: JsonValue = codecs.decode_json(data)
        if not isinstance(document, dict) or "text" not in document:
            raise codecs.CodecError(f"a text payload is a JSON object with 'text', got {type(document).__name__}")
        return str(document["text"])
    if modality in TENSOR_MODALITIES:
        return codecs.decode_tensors(data)[modality]
    if modality == "image":
        return codecs.decode_png(data)
    if modality == "audio":
        samples, rate = codecs.decode_wav(data)
        return AudioClip(samples, rate)
    if modality == "video":
        frames, fps = mp4.decode_mp4(data)
        return VideoClip(frames, fps)
    raise ValueError(f"no decoder for modality '{modality}'")
