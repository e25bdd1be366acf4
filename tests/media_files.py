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
