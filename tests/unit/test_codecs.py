"""Codecs: round trips, deterministic bytes, and clear errors on bad input."""

from __future__ import annotations

import io
import struct
import wave
import zlib

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from omni_jobs.artifacts import codecs
from omni_jobs.artifacts.codecs import (
    CodecError,
    decode_json,
    decode_png,
    decode_tensors,
    decode_wav,
    encode_json,
    encode_png,
    encode_tensors,
    encode_wav,
    png_info,
    wav_info,
)


def _png_chunk_types(data: bytes) -> list[bytes]:
    pos, types = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        types.append(data[pos + 4 : pos + 8])
        pos += 12 + length
    return types


def _png_with_text(image: Image.Image) -> bytes:
    meta = PngImagePlugin.PngInfo()
    meta.add_text("Comment", "hello")
    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=meta, dpi=(72, 72))
    return buf.getvalue()


# --- tensors ---
@pytest.fixture(scope="module")
def torch():  # type: ignore[no-untyped-def]
    return pytest.importorskip("torch")


def test_tensors_round_trip_keeps_dtype_shape_and_values(torch) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    tensors = {
        "latents": torch.randn(2, 4, 8, 8, generator=g),
        "embeds": torch.randn(3, 16, generator=g).to(torch.bfloat16),
        "ids": torch.arange(10, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
    out = decode_tensors(encode_tensors(tensors))
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t)


def test_tensors_bytes_are_deterministic(torch) -> None:  # type: ignore[no-untyped-def]
    t = {"b": torch.ones(3), "a": torch.zeros(2, 2)}
    assert encode_tensors(t) == encode_tensors(dict(reversed(list(t.items()))))


def test_tensors_non_contiguous_views_and_shared_storage_are_stored(torch) -> None:  # type: ignore[no-untyped-def]
    x = torch.arange(12.0).reshape(3, 4)
    out = decode_tensors(encode_tensors({"t": x.T, "row0": x[0], "same": x, "again": x}))
    assert torch.equal(out["t"], x.T) and torch.equal(out["row0"], x[0])
    assert torch.equal(out["same"], x) and torch.equal(out["again"], x)


def test_tensors_with_grad_and_metadata(torch) -> None:  # type: ignore[no-untyped-def]
    w = torch.ones(2, requires_grad=True) * 2
    data = encode_tensors({"w": w}, metadata={"stage": "ar"})
    assert torch.equal(decode_tensors(data)["w"], torch.full((2,), 2.0))


def test_decode_tensors_rejects_garbage() -> None:
    pytest.importorskip("torch")
    with pytest.raises(CodecError, match="not safetensors"):
        decode_tensors(b"garbage bytes")


# --- PNG ---
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "1", "I;16"])
def test_png_round_trip(mode: str) -> None:
    arr = np.random.default_rng(0).integers(0, 255, size=(5, 7, 3), dtype=np.uint8)
    image = Image.fromarray(arr, "RGB").convert(mode)
    out = decode_png(encode_png(image))
    assert out.mode == image.mode and out.size == (7, 5)
    assert out.tobytes() == image.tobytes()


def test_png_palette_with_transparency_round_trip() -> None:
    image = Image.new("P", (4, 4), 1)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * (256 * 3 - 6))
    image.info["transparency"] = 0
    out = decode_png(encode_png(image))
    assert out.mode == "P" and out.tobytes() == image.tobytes() and out.info.get("transparency") == 0


def test_png_bytes_carry_no_metadata_and_are_deterministic() -> None:
    image = Image.new("RGB", (8, 8), (10, 20, 30))
    noisy = image.copy()
    noisy.info.update({"icc_profile": b"fake", "dpi": (300, 300), "exif": b"Exif\x00\x00", "Software": "x"})
    reloaded = Image.open(io.BytesIO(_png_with_text(image)))  # info holds a tEXt chunk and pHYs
    assert reloaded.info.get("Comment") == "hello"
    a, b, c = encode_png(image), encode_png(noisy), encode_png(reloaded)
    assert a == b == c
    chunks = _png_chunk_types(a)
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND"
    assert not {b"tEXt", b"zTXt", b"iTXt", b"tIME", b"iCCP", b"eXIf", b"pHYs"} & set(chunks)


def test_png_info_reads_header() -> None:
    data = encode_png(Image.new("RGBA", (33, 17)))
    assert png_info(data) == {"width": 33, "height": 17, "mode": "RGBA"}


def test_png_rejects_unencodable_mode_and_non_png() -> None:
    with pytest.raises(CodecError, match="convert"):
        encode_png(Image.new("F", (2, 2)))
    jpeg = io.BytesIO()
    Image.new("RGB", (2, 2)).save(jpeg, format="JPEG")
    with pytest.raises(CodecError, match="expected PNG"):
        decode_png(jpeg.getvalue())
    with pytest.raises(CodecError, match="not an image"):
        png_info(b"nope")


def test_truncated_png_is_a_codec_error() -> None:
    data = encode_png(Image.effect_noise((64, 64), 50))
    with pytest.raises(CodecError):
        decode_png(data[: len(data) // 2])


# --- JSON ---
def test_json_round_trip_and_sorted_compact_utf8() -> None:
    obj = {"b": [1, 2.5, None, True], "a": "héllo ✓", "nested": {"z": 1, "y": {}}}
    data = encode_json(obj)
    assert decode_json(data) == obj
    assert data.startswith(b'{"a":"h\xc3\xa9llo')
    assert encode_json({"y": 1, "x": 2}) == encode_json({"x": 2, "y": 1}) == b'{"x":2,"y":1}'


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), {1, 2}, b"bytes"])
def test_json_refuses_non_json_values(bad: object) -> None:
    with pytest.raises(CodecError, match="JSON"):
        encode_json({"v": bad})


@pytest.mark.parametrize("bad", [b"{not json", b"\xff\xfe", b""])
def test_decode_json_rejects_bad_bytes(bad: bytes) -> None:
    with pytest.raises(CodecError):
        decode_json(bad)


# --- WAV ---
def test_wav_mono_round_trip_within_one_lsb() -> None:
    t = np.linspace(0, 1, 16000, endpoint=False)
    samples = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    decoded, rate = decode_wav(encode_wav(samples, 16000))
    assert rate == 16000 and decoded.shape == (1, 16000) and decoded.dtype == np.float32
    assert np.max(np.abs(decoded[0] - samples)) <= 1 / 32767 + 1e-7


def test_wav_stereo_keeps_channel_order() -> None:
    left, right = np.full(100, 0.25), np.full(100, -0.75)
    decoded, rate = decode_wav(encode_wav(np.stack([left, right]), 44100))
    assert rate == 44100 and decoded.shape == (2, 100)
    np.testing.assert_allclose(decoded[0], 0.25, atol=1e-4)
    np.testing.assert_allclose(decoded[1], -0.75, atol=1e-4)


def test_wav_clips_out_of_range_and_is_deterministic() -> None:
    data = encode_wav(np.array([2.0, -3.0, 1.0, -1.0]), 8000)
    decoded, _ = decode_wav(data)
    np.testing.assert_allclose(decoded[0], [1.0, -1.0, 1.0, -1.0])
    assert data == encode_wav(np.array([2.0, -3.0, 1.0, -1.0]), 8000)
    with wave.open(io.BytesIO(data)) as w:
        assert w.getsampwidth() == 2 and w.getcomptype() == "NONE"


def test_wav_info() -> None:
    data = encode_wav(np.zeros((2, 24000)), 48000)
    assert wav_info(data) == {"sample_rate": 48000, "channels": 2, "duration_s": 0.5}


@pytest.mark.parametrize(
    ("samples", "rate", "match"),
    [
        (np.zeros(10), 0, "sample_rate"),
        (np.zeros(10), 16000.0, "sample_rate"),
        (np.zeros((2, 2, 2)), 16000, r"\[channels, n\]"),
        (np.zeros((1000, 2)), 16000, "transpose"),
        (np.array([0.0, np.nan]), 16000, "NaN"),
    ],
)
def test_wav_rejects_bad_input(samples: np.ndarray, rate: int, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        encode_wav(samples, rate)


@pytest.mark.parametrize("width", [1, 3, 4])
def test_decode_wav_other_pcm_widths(width: int) -> None:
    full = {1: 127, 3: 2**23 - 1, 4: 2**31 - 1}[width]
    values = [0, full, -full]
    if width == 1:
        raw = bytes(v + 128 for v in values)
    else:
        raw = b"".join(v.to_bytes(width, "little", signed=True) for v in values)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(width)
        w.setframerate(8000)
        w.writeframes(raw)
    decoded, rate = decode_wav(buf.getvalue())
    assert rate == 8000
    np.testing.assert_allclose(decoded[0], [0.0, 1.0, -1.0], atol=1e-6)


def test_decode_wav_rejects_garbage() -> None:
    with pytest.raises(CodecError, match="WAV"):
        decode_wav(b"RIFF....nope")
    with pytest.raises(CodecError, match="WAV"):
        wav_info(zlib.compress(b"x"))


def test_media_types_and_extensions() -> None:
    assert codecs.extension_for(codecs.MEDIA_PNG) == ".png"
    assert codecs.extension_for(codecs.MEDIA_WAV) == ".wav"
    assert codecs.extension_for(codecs.MEDIA_SAFETENSORS) == ".safetensors"
    assert codecs.extension_for("application/x-unknown") == ".bin"


@pytest.mark.parametrize("mode", ["L", "RGB", "P", "LA", "RGBA", "1", "I;16"])
def test_png_info_reads_the_same_as_pil(mode: str) -> None:
    data = encode_png(Image.new(mode, (7, 5)))
    assert png_info(data) == {"width": 7, "height": 5, "mode": Image.open(io.BytesIO(data)).mode}
