"""Media types and pure encode/decode functions for what stages hand each other. No pickle.

Tensors are safetensors, images PNG, audio 16-bit PCM WAV, structured data JSON. Encoders are
deterministic (same input, same bytes) so a retried stage writes the same sha256 and a test can
compare outputs byte for byte. torch is imported only inside the tensor functions.
"""

from __future__ import annotations

import io
import json
import struct
import wave
from typing import TYPE_CHECKING, TypedDict

import numpy as np
import numpy.typing as npt
from PIL import Image

if TYPE_CHECKING:
    import torch

    from omni_jobs.core.json_types import JsonValue

MEDIA_SAFETENSORS = "application/vnd.safetensors"
MEDIA_PNG = "image/png"
MEDIA_WAV = "audio/wav"
MEDIA_MP4 = "video/mp4"
MEDIA_JSON = "application/json"
MEDIA_TEXT = "text/plain; charset=utf-8"
MEDIA_OCTET = "application/octet-stream"

EXTENSIONS: dict[str, str] = {
    MEDIA_SAFETENSORS: ".safetensors",
    MEDIA_PNG: ".png",
    MEDIA_WAV: ".wav",
    MEDIA_MP4: ".mp4",
    MEDIA_JSON: ".json",
    MEDIA_TEXT: ".txt",
    MEDIA_OCTET: ".bin",
}
"""File extension for each media type (results name their output files with these)."""

_PNG_MODES = frozenset({"1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"})
_PCM16_MAX = 32767
_MAX_CHANNELS = 32


class CodecError(ValueError):
    """Bytes that do not decode as the expected format, or a value that cannot be encoded."""


def extension_for(media_type: str) -> str:
    """The file extension for ``media_type`` ('.bin' when unknown)."""
    return EXTENSIONS.get(media_type, ".bin")


# --- tensors ---
def encode_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """safetensors bytes of CPU, contiguous copies of ``tensors`` (device and layout do not matter)."""
    import safetensors.torch

    prepared = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    try:
        return safetensors.torch.save(prepared, metadata=metadata)
    except RuntimeError as exc:
        if "share memory" not in str(exc):
            raise CodecError(f"cannot encode tensors {sorted(tensors)}: {exc}") from exc
        # The same tensor under two names: store independent copies.
        return safetensors.torch.save({n: t.clone() for n, t in prepared.items()}, metadata=metadata)


def decode_tensors(data: bytes, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Tensors from safetensors bytes (never pickle), moved to ``device``."""
    from safetensors.torch import load as load_safetensors

    try:
        tensors = load_safetensors(bytes(data))
    except Exception as exc:  # SafetensorError does not subclass anything more specific
        raise CodecError(f"not safetensors data ({len(data)} bytes): {exc}") from exc
    if device != "cpu":
        tensors = {name: t.to(device) for name, t in tensors.items()}
    return tensors


# --- images ---
def encode_png(image: Image.Image) -> bytes:
    """PNG bytes with no metadata (no text chunks, ICC, EXIF or timestamps): same pixels, same bytes."""
    if image.mode not in _PNG_MODES:
        raise CodecError(f"cannot write image mode {image.mode!r} as PNG; convert it first, e.g. .convert('RGB')")
    clean = image.copy()
    clean.info = {k: v for k, v in image.info.items() if k == "transparency"}
    buf = io.BytesIO()
    clean.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def _open_png(data: bytes) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
    except Exception as exc:
        raise CodecError(f"not an image ({len(data)} bytes): {exc}") from exc
    if image.format != "PNG":
        raise CodecError(f"expected PNG, got {image.format}")
    return image


def decode_png(data: bytes) -> Image.Image:
    """A fully loaded PIL image from PNG bytes."""
    image = _open_png(data)
    try:
        image.load()
    except Exception as exc:
        raise CodecError(f"corrupt PNG ({len(data)} bytes): {exc}") from exc
    return image


class PngInfo(TypedDict):
    width: int
    height: int
    mode: str


_PNG_SIGNATURE_AND_IHDR = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
_PNG_8BIT_MODES = {0: "L", 2: "RGB", 3: "P", 4: "LA", 6: "RGBA"}
"""PIL's mode of an 8-bit PNG by its colour type (the others are read by PIL)."""


def png_info(data: bytes) -> PngInfo:
    """Width, height and mode of PNG bytes, read from the header only.

    An 8-bit PNG's header is read here (a few microseconds); PIL reads the rest, and anything that is
    not a PNG (its errors name what it is). Every image job's output passes through here."""
    if data[:16] == _PNG_SIGNATURE_AND_IHDR and len(data) >= 26:
        width, height, depth, colour = struct.unpack(">IIBB", data[16:26])
        mode = _PNG_8BIT_MODES.get(colour) if depth == 8 else None
        if mode is not None and width > 0 and height > 0:
            return {"width": width, "height": height, "mode": mode}
    image = _open_png(data)
    return {"width": image.width, "height": image.height, "mode": image.mode}


# --- JSON ---
def encode_json(obj: object) -> bytes:
    """Compact UTF-8 JSON with sorted keys; NaN/Infinity are refused (they are not JSON)."""
    try:
        text = json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CodecError(f"cannot encode as JSON: {exc}") from exc
    return text.encode("utf-8")


def decode_json(data: bytes) -> JsonValue:
    """The value encoded in UTF-8 JSON bytes: its reader narrows it (an object, its fields)."""
    try:
        value: JsonValue = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CodecError(f"not UTF-8 JSON ({len(data)} bytes): {exc}") from exc
    return value


# --- audio ---
def encode_wav(samples: npt.ArrayLike, sample_rate: int) -> bytes:
    """16-bit PCM WAV from float samples in [-1, 1], shaped [n] (mono) or [channels, n].

    Values outside [-1, 1] are clipped; NaN or infinite samples are refused.
    """
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
        raise CodecError(f"sample_rate must be a positive int, got {sample_rate!r}")
    arr = np.asarray(samples, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[np.newaxis, :]
    if arr.ndim != 2 or arr.shape[0] < 1:
        raise CodecError(f"audio must be shaped [n] or [channels, n], got {list(np.shape(samples))}")
    if arr.shape[0] > _MAX_CHANNELS:
        raise CodecError(
            f"audio shaped {list(arr.shape)} has more than {_MAX_CHANNELS} channels: "
            "is it [n, channels]? pass [channels, n] (transpose it)"
        )
    if not np.isfinite(arr).all():
        raise CodecError("audio contains NaN or infinite samples")
    pcm = np.round(np.clip(arr, -1.0, 1.0) * _PCM16_MAX).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(int(arr.shape[0]))
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(np.ascontiguousarray(pcm.T).tobytes())
    return buf.getvalue()


def _open_wav(data: bytes) -> wave.Wave_read:
    try:
        return wave.open(io.BytesIO(data), "rb")
    except (wave.Error, EOFError) as exc:
        raise CodecError(f"not a PCM WAV ({len(data)} bytes): {exc}") from exc


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    """float32 samples shaped [channels, n] (always 2-D, even for mono) and the sample rate."""
    with _open_wav(data) as w:
        channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
        raw = w.readframes(w.getnframes())
    if width == 1:
        ints = np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0
        scale = 127.0
    elif width == 2:
        ints = np.frombuffer(raw, dtype="<i2").astype(np.float32)
        scale = float(_PCM16_MAX)
    elif width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        ints = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8).astype(np.float32)
        scale = float(2**23 - 1)
    elif width == 4:
        ints = np.frombuffer(raw, dtype="<i4").astype(np.float32)
        scale = float(2**31 - 1)
    else:
        raise CodecError(f"unsupported WAV sample width {width} bytes")
    samples = np.clip(ints / scale, -1.0, 1.0).astype(np.float32)
    return samples.reshape(-1, channels).T.copy(), rate


class WavInfo(TypedDict):
    sample_rate: int
    channels: int
    duration_s: float


def wav_info(data: bytes) -> WavInfo:
    """Sample rate, channel count and duration of WAV bytes, read from the header."""
    with _open_wav(data) as w:
        rate, channels, frames = w.getframerate(), w.getnchannels(), w.getnframes()
    return {"sample_rate": rate, "channels": channels, "duration_s": frames / rate if rate else 0.0}
