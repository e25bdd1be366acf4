"""Audio and video files made in the tests (PyAV, numpy; nothing binary is committed): a sine in each
audio format, an MP4 of moving stripes, and the bad files the input checks must refuse."""

from __future__ import annotations

import io
import struct
import zipfile

import av
import numpy as np

from omni_jobs.artifacts import codecs
from omni_jobs.artifacts.mp4 import encode_mp4

AUDIO_FORMATS = {  # name -> (container, encoder, data: URI type)
    "wav": ("wav", "pcm_s16le", "audio/wav"),
    "flac": ("flac", "flac", "audio/flac"),
    "mp3": ("mp3", "libmp3lame", "audio/mpeg"),
    "ogg": ("ogg", "vorbis", "audio/ogg"),
    "opus": ("ogg", "libopus", "audio/ogg"),
    "m4a": ("ipod", "aac", "audio/mp4"),
}


def sine(seconds: float = 1.0, rate: int = 16_000, channels: int = 1, hz: float = 440.0) -> np.ndarray:
    """float32 [channels, n]: a sine at half scale (each channel a little higher)."""
    t = np.arange(round(seconds * rate)) / rate
    return np.stack([0.5 * np.sin(2 * np.pi * hz * (1 + c / 4) * t) for c in range(channels)]).astype(np.float32)


def wav(seconds: float = 1.0, rate: int = 16_000, channels: int = 1) -> bytes:
    return codecs.encode_wav(sine(seconds, rate, channels), rate)


def encode_audio(name: str, seconds: float = 1.0, rate: int = 16_000, channels: int = 1) -> bytes:
    """A sine encoded as ``name`` (a key of AUDIO_FORMATS) by PyAV's own encoders."""
    if name == "wav":
        return wav(seconds, rate, channels)
    container_format, encoder, _ = AUDIO_FORMATS[name]
    rate = 48_000 if encoder == "libopus" else rate  # Opus runs at 48 kHz
    channels = 2 if encoder == "vorbis" else channels  # FFmpeg's own Vorbis encoder writes stereo only
    samples = sine(seconds, rate, channels)
    layout = "mono" if channels == 1 else "stereo"
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format) as container:
        stream = container.add_stream(encoder, rate=rate, layout=layout)
        if encoder == "vorbis":
            stream.codec_context.options = {"strict": "experimental"}  # FFmpeg's own Vorbis encoder
        context = stream.codec_context
        context.open()
        size = context.frame_size or 1024
        planar = context.format.is_planar
        kind = context.format.name.rstrip("p")
        for start in range(0, samples.shape[1], size):
            chunk = samples[:, start:start + size]
            if kind == "s16":
                chunk = np.round(chunk * 32767).astype(np.int16)
            elif kind == "s32":
                chunk = np.round(chunk * (2**31 - 1)).astype(np.int32)
            array = chunk if planar else chunk.T.reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(array), format=context.format.name, layout=layout)
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def stripes(frames: int = 12, height: int = 32, width: int = 48) -> np.ndarray:
    """uint8 [n, h, w, 3]: diagonal stripes that move a little each frame."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([np.stack([(x + y + 3 * i) * 8 % 256, y * 255 // height, np.full_like(x, 40 + i)], axis=-1)
                     for i in range(frames)]).astype(np.uint8)


def mp4(frames: int = 12, height: int = 32, width: int = 48, fps: float = 12.0) -> bytes:
    return encode_mp4(stripes(frames, height, width), fps)


def webm(frames: int = 6, height: int = 31, width: int = 47, fps: float = 10.0) -> bytes:
    """VP9 in WebM with odd sides: a video that must be re-encoded (and cropped to even sides)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="webm") as container:
        stream = container.add_stream("libvpx-vp9", rate=round(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i, pixels in enumerate(stripes(frames, height, width)):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def audio_only_mp4(seconds: float = 0.5) -> bytes:
    """An MP4 (M4A) with an AAC track and no video stream."""
    buffer = io.BytesIO()
    data = encode_audio("m4a", seconds)
    with av.open(io.BytesIO(data)) as source, av.open(buffer, "w", format="mp4") as target:
        stream = target.add_stream_from_template(source.streams.audio[0])
        for packet in source.demux(source.streams.audio[0]):
            if packet.dts is None:
                continue
            packet.stream = stream
            target.mux(packet)
    return buffer.getvalue()


def lying_wav(claimed_seconds: float, held_seconds: float = 0.5, rate: int = 16_000) -> bytes:
    """A mono 16-bit WAV whose RIFF and data sizes claim ``claimed_seconds`` but hold ``held_seconds``."""
    data = wav(held_seconds, rate)
    claimed = int(claimed_seconds * rate * 2)
    index = data.index(b"data")
    return (data[:4] + struct.pack("<I", min(claimed + index - 4, 0xFFFFFFFE)) + data[8:index + 4]
            + struct.pack("<I", min(claimed, 0xFFFFFFFE)) + data[index + 8:])


def understated_mp3(seconds: float = 3.0, claimed_fraction: int = 3) -> bytes:
    """An MP3 whose Info (Xing) header claims a third of its frames: FFmpeg takes its length from there."""
    data = encode_audio("mp3", seconds)
    at = data.index(b"Info")
    frames = struct.unpack(">I", data[at + 8:at + 12])[0]
    return data[:at + 8] + struct.pack(">I", frames // claimed_fraction) + data[at + 12:]


def zip_file() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("movie.txt", "not a movie " * 200)
    return buffer.getvalue()


MEDIA_PIPELINE = {
    "name": "media-inputs",
    "description": "A test pipeline with audio and video inputs beside its prompt (no stage reads them: the inputs "
                   "are checked, stored and recorded all the same).",
    "inputs": {"prompt": {"type": "text"},
               "speech": {"type": "audio", "required": False, "description": "Something said."},
               "clip": {"type": "video", "required": False, "max_bytes": 1_000_000}},
    "stages": [{"id": "ar", "engine": "ar", "model": "tiny:llama", "inputs": {"prompt": "input.prompt"},
                "defaults": {"max_tokens": 4}}],
    "outputs": [{"name": "text", "from": "ar.text"}],
}
"""A pipeline (YAML as a dict) whose job inputs include audio and video."""


# --- malformed files: what every upload path must refuse with a 4xx (tests/integration/test_malformed_media.py) ---
def _png(width: int = 24, height: int = 16) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 60)).save(buffer, format="PNG")
    return buffer.getvalue()


def _jpeg(width: int = 24, height: int = 16) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (20, 130, 60)).save(buffer, format="JPEG")
    return buffer.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (its CRC fixed), holding a 1x1 image's data."""
    import zlib

    data = bytearray(_png(1, 1))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])) & 0xFFFFFFFF)
    return bytes(data)


def _wav_header(channels: int, rate: int, bits: int, data_size: int = 64) -> bytes:
    """A WAV header with the given fields (nonsense ones included) and ``data_size`` bytes of data."""
    block = max(1, channels * bits // 8) & 0xFFFF
    fmt = struct.pack("<HHIIHH", 1, channels, rate, (rate * block) & 0xFFFFFFFF, block, bits)
    body = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", data_size) + bytes(data_size)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _damaged(name: str, data: bytes, seed: int) -> dict[str, bytes]:
    """Cuts of ``data`` (its header only, a tenth, half, all but its last bytes) and copies with bytes
    overwritten at random (seeded) past the first 8, so that the type still looks right."""
    rng = np.random.default_rng(seed)
    out = {f"{name}-cut-{label}": data[:size] for label, size in
           (("header", min(len(data), 32)), ("tenth", len(data) // 10), ("half", len(data) // 2),
            ("end", max(1, len(data) - 7)))}
    for n in range(3):
        mangled = bytearray(data)
        where = rng.integers(8, max(9, len(data)), size=max(1, len(data) // 50))
        mangled_values = rng.integers(0, 256, size=len(where), dtype=np.uint8)
        for at, value in zip(where, mangled_values, strict=True):
            mangled[int(at)] = int(value)
        out[f"{name}-flipped-{n}"] = bytes(mangled)
    return out


def malformed_corpus() -> dict[str, dict[str, bytes]]:
    """File type -> name -> bytes that are not a usable file of that type: empty, random, another
    format, cut short, overwritten at random, or lying in their headers (sizes, channels, rates)."""
    rng = np.random.default_rng(62)
    common = {"empty": b"", "one-byte": b"\x00", "random": rng.bytes(4096), "text": b"hello, not a file\n" * 20,
              "zip": zip_file(), "html": b"<!doctype html><html><body>not media</body></html>"}
    image = {**common, "gif-header": b"GIF89a", "bmp-header": b"BM" + bytes(12),
             "png-signature-only": b"\x89PNG\r\n\x1a\n", "jpeg-soi-only": b"\xff\xd8\xff",
             "webp-header": b"RIFF\x10\x00\x00\x00WEBPVP8 ", "tiff-header": b"II*\x00\x08\x00\x00\x00",
             "png-claims-1e5-square": _png_claiming(100_000, 100_000), "png-claims-0x0": _png_claiming(0, 0),
             "svg": b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
             "wav-as-image": wav(0.1),
             **_damaged("png", _png(), 1), **_damaged("jpeg", _jpeg(), 2)}
    audio = {**common, "wav-header-only": wav(0.5)[:44], "wav-zero-channels": _wav_header(0, 16_000, 16),
             "wav-zero-rate": _wav_header(1, 0, 16), "wav-65535-channels": _wav_header(65535, 16_000, 16),
             "wav-3-bits": _wav_header(1, 16_000, 3), "wav-huge-rate": _wav_header(2, 0xFFFFFFFF, 16),
             "wav-claims-a-day": lying_wav(86_400.0), "ogg-capture-only": b"OggS" + bytes(23),
             "mp3-sync-only": b"\xff\xfb\x90\x64" + bytes(100), "png-as-audio": _png(),
             **_damaged("wav", wav(0.5), 3), **_damaged("mp3", encode_audio("mp3", 0.5), 4),
             **_damaged("m4a", encode_audio("m4a", 0.5), 5), **_damaged("ogg", encode_audio("ogg", 0.5), 6)}
    video = {**common, "mp4-ftyp-only": mp4()[:32], "audio-only-mp4": audio_only_mp4(0.3),
             "avi-header": b"RIFF\x00\x01\x00\x00AVI LIST" + bytes(40), "mkv-header": b"\x1aE\xdf\xa3" + bytes(60),
             "png-as-video": _png(), "wav-as-video": wav(0.2),
             **_damaged("mp4", mp4(), 7), **_damaged("webm", webm(), 8)}
    return {"image": image, "audio": audio, "video": video}
