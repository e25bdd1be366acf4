"""Audio and video files read with PyAV (FFmpeg), within limits: what a job's audio or video input decodes to.

The API reads an upload here before it creates a job, and a stage reads a stored input, so both
read files one way. Only the demuxers listed below are opened: FFmpeg's others (playlists, concat
lists, image sequences) can open further files or URLs. A file's declared length is checked before
anything is decoded, and what is decoded is counted as it comes, since a header can lie; a file
that declares more than it holds is refused as truncated.

Errors are ``MediaError`` with a message that completes "input.<name> ..." (the API's 422).
PyAV is imported only inside the functions.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from types import TracebackType
from typing import TYPE_CHECKING, Literal, Self

import numpy as np

from omni_jobs.media.payloads import AudioClip, VideoClip

if TYPE_CHECKING:
    import av.audio.frame
    import av.audio.stream
    import av.container
    import av.stream
    import av.video.stream

MediaKind = Literal["audio", "video"]

AUDIO_FORMATS = "wav,w64,mp3,ogg,flac,mov,mp4,m4a,matroska,webm,aac,aiff"
VIDEO_FORMATS = "mov,mp4,m4a,matroska,webm,avi"
"""The demuxers a file may be read with (FFmpeg's ``format_whitelist``); M4A and MP4 are ``mov``."""
FORMATS_IN_WORDS = {"audio": "WAV, MP3, OGG (Vorbis, Opus), FLAC, M4A/MP4 (AAC), WebM/Matroska, AAC, AIFF",
                    "video": "MP4/MOV, WebM/Matroska, AVI"}

AUDIO_CODECS = frozenset({"mp3", "mp3float", "mp2", "mp2float", "vorbis", "opus", "libopus", "flac", "aac",
                          "aac_fixed", "alac"})
"""Audio decoders used, beside every PCM one (pcm_*)."""
VIDEO_CODECS = frozenset({"h264", "hevc", "vp8", "libvpx", "vp9", "libvpx-vp9", "av1", "libdav1d", "mpeg4",
                          "mpeg2video", "mjpeg"})

MAX_CHANNELS = 8
SAMPLE_BUDGET_PER_S = 48_000 * 2
"""Decoded samples (all channels) per second of the length limit: 48 kHz stereo for the whole limit;
96 kHz stereo for half of it. Compressed silence is small, so bytes alone do not bound memory."""
INT_FULL_SCALE = {"s16": 32767, "s32": 2**31 - 1}
"""Integer sample formats, read as codecs.decode_wav reads them (the largest value is 1.0)."""
TRUNCATION_SLACK_S = 0.1
"""How far short of its declared length a file may decode (codec delay, padding) before it counts as truncated."""


class MediaError(ValueError):
    """A file that is not accepted audio or video, or is over a limit; the message completes 'input.<name> ...'."""


@dataclass(frozen=True)
class MediaLimits:
    """What one file may hold; None: no limit. The setting names go in the errors."""

    max_seconds: float | None = None
    max_frames: int | None = None
    max_pixels: int | None = None
    seconds_setting: str = ""
    frames_setting: str = ""
    pixels_setting: str = ""


def _setting(name: str) -> str:
    return f" ({name})" if name else ""


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value < 100 else f"{value:,.0f} s"


def _open(data: bytes, kind: MediaKind) -> av.container.InputContainer:
    import av

    if not data:
        raise MediaError("is empty")
    formats = AUDIO_FORMATS if kind == "audio" else VIDEO_FORMATS
    try:
        return av.open(io.BytesIO(data), mode="r", options={"format_whitelist": formats})
    except av.error.ArgumentError:  # what FFmpeg says of a format off the whitelist: no name given
        raise MediaError(f"is not in a format taken as {kind} ({len(data)} bytes); send "
                         f"{FORMATS_IN_WORDS[kind]}") from None
    except (av.error.FFmpegError, ValueError) as exc:
        reason = _reason(exc)
        if isinstance(exc, av.error.EOFError):
            reason += " (is it truncated?)"
        raise MediaError(f"is not {kind} FFmpeg can read ({len(data)} bytes): {reason}; {kind} is taken as "
                         f"{FORMATS_IN_WORDS[kind]}") from None


def _reason(exc: BaseException) -> str:
    import av

    if isinstance(exc, av.error.FFmpegError):
        return str(exc.strerror or exc).rstrip(".")
    return str(exc)


def _no_stream(container: av.container.InputContainer, kind: MediaKind) -> MediaError:
    held: list[str] = sorted({str(s.type) for s in container.streams}) or ["nothing"]
    return MediaError(f"has no {kind} stream ({container.format.name.split(',')[0]} file holding "
                      f"{' and '.join(held)})")


def _check_codec(context: av.codec.context.CodecContext | None, kind: MediaKind) -> None:
    """The stream's codec is one taken; a stream whose codec FFmpeg does not know has no context at all
    (a damaged M4A's, say), refused as such rather than an AttributeError (a 500)."""
    if context is None:
        raise MediaError(f"holds {kind} in a codec FFmpeg does not know (is the file damaged?)")
    name = context.name
    codecs = AUDIO_CODECS if kind == "audio" else VIDEO_CODECS
    if name not in codecs and not (kind == "audio" and name.startswith("pcm_")):
        raise MediaError(f"holds {kind} in codec '{name}', which is not taken; codecs: {sorted(codecs)}"
                         + (" or PCM" if kind == "audio" else ""))


def _audio_stream(container: av.container.InputContainer) -> av.audio.stream.AudioStream:
    if not container.streams.audio:
        raise _no_stream(container, "audio")
    stream = container.streams.audio[0]
    _check_codec(stream.codec_context, "audio")
    return stream


def _video_stream(container: av.container.InputContainer) -> av.video.stream.VideoStream:
    if not container.streams.video:
        raise _no_stream(container, "video")
    stream = container.streams.video[0]
    _check_codec(stream.codec_context, "video")
    return stream


def _declared_seconds(container: av.container.InputContainer, stream: av.stream.Stream, data: bytes) -> float | None:
    """The length the file says its stream has: the stream's own (else the container's, which is its
    longest stream's), or a WAV's data chunk's where that is longer (FFmpeg trims it to the bytes present)."""
    found: list[float] = []
    if stream.duration and stream.time_base:
        found.append(float(stream.duration * stream.time_base))
    elif container.duration:
        found.append(container.duration / 1_000_000)
    if container.format.name == "wav":
        wav = wav_declared_seconds(data)
        if wav is not None:
            found.append(wav)
    return max(found) if found else None


def wav_declared_seconds(data: bytes) -> float | None:
    """Seconds a RIFF WAV's data chunk declares (size / byte rate); None when it declares none (a
    streamed WAV's 0 or 0xFFFFFFFF) or the header cannot be read."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos, byte_rate = 12, 0
    while pos + 8 <= len(data):
        chunk, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        if chunk == b"fmt " and size >= 16 and pos + 24 <= len(data):
            byte_rate = struct.unpack("<I", data[pos + 16:pos + 20])[0]
        elif chunk == b"data":
            if not byte_rate or size in (0, 0xFFFFFFFF):
                return None
            return float(size) / byte_rate
        pos += 8 + size + (size & 1)
    return None


def _check_declared(declared: float | None, limits: MediaLimits) -> None:
    if declared is not None and limits.max_seconds is not None and declared > limits.max_seconds:
        raise MediaError(f"is {_seconds(declared)} long (as its header says); at most "
                         f"{_seconds(limits.max_seconds)}{_setting(limits.seconds_setting)}")


def _check_truncated(declared: float | None, decoded: float) -> None:
    if declared is not None and decoded + max(TRUNCATION_SLACK_S, declared / 100) < declared:
        raise MediaError(f"is truncated or damaged: its header says {_seconds(declared)}, but only "
                         f"{_seconds(decoded)} decode")


# --- audio ---
def decode_audio(data: bytes, limits: MediaLimits | None = None) -> AudioClip:
    """float32 samples [channels, n] in [-1, 1] and their rate, of the first audio stream of ``data``
    (any file FFmpeg reads as one of AUDIO_FORMATS: a video's sound too)."""
    import av

    limits = limits or MediaLimits()
    with _open(data, "audio") as container:
        stream = _audio_stream(container)
        context = stream.codec_context
        rate, channels = int(context.sample_rate or 0), int(context.channels or 0)
        if rate <= 0 or channels <= 0:
            raise MediaError(f"declares no sample rate or channels (rate {rate}, {channels} channels)")
        if channels > MAX_CHANNELS:
            raise MediaError(f"has {channels} channels; at most {MAX_CHANNELS}")
        declared = _declared_seconds(container, stream, data)
        _check_declared(declared, limits)
        budget = None
        if limits.max_seconds is not None:
            budget = int(limits.max_seconds * SAMPLE_BUDGET_PER_S)
            if declared is not None and declared * rate * channels > budget:
                raise MediaError(_over_budget(declared * rate * channels, budget, limits))
        # Integer PCM is scaled as codecs.decode_wav scales it (full scale 32767 is 1.0: a 16-bit WAV comes
        # back sample for sample); FFmpeg's own float conversion divides by 32768.
        kind = context.format.name.rstrip("p")
        scale = INT_FULL_SCALE.get(kind)
        resampler = av.AudioResampler(format=f"{kind}p" if scale else "fltp", layout=context.layout, rate=rate)
        chunks: list[np.ndarray] = []
        count = 0
        try:
            for frame in _audio_frames(container, stream, resampler):
                samples = frame.to_ndarray()
                samples = samples.astype(np.float32) / np.float32(scale) if scale else samples
                chunks.append(samples)
                count += samples.shape[-1]
                if limits.max_seconds is not None and count > limits.max_seconds * rate:
                    raise MediaError(f"is longer than {_seconds(limits.max_seconds)} (counted as it decoded, "
                                     f"whatever its header says){_setting(limits.seconds_setting)}")
                if budget is not None and count * channels > budget:
                    raise MediaError(_over_budget(count * channels, budget, limits))
        except av.error.FFmpegError as exc:
            raise MediaError(f"cannot be decoded as audio (damaged or truncated?): {_reason(exc)}") from None
    if not count:
        raise MediaError("holds no audio samples")
    _check_truncated(declared, count / rate)
    samples = np.concatenate(chunks, axis=1) if len(chunks) > 1 else chunks[0]
    np.clip(samples, -1.0, 1.0, out=samples)
    return AudioClip(np.ascontiguousarray(samples, dtype=np.float32), rate)


def _audio_frames(container: av.container.InputContainer, stream: av.audio.stream.AudioStream,
                  resampler: av.AudioResampler) -> Iterator[av.audio.frame.AudioFrame]:
    """Every decoded frame as float planar at the first frame's rate and layout (a stream may change them)."""
    for packet in container.demux(stream):
        for frame in stream.decode(packet):
            yield from resampler.resample(frame)
    yield from resampler.resample(None)


def _over_budget(samples: float, budget: int, limits: MediaLimits) -> str:
    return (f"decodes to more than {budget:,} samples ({samples:,.0f}): the limit is "
            f"{_seconds(limits.max_seconds or 0)} of 48 kHz stereo{_setting(limits.seconds_setting)}; "
            "send fewer channels or a lower sample rate")


def resample_audio(clip: AudioClip, rate: int, mono: bool = True) -> AudioClip:
    """``clip`` at ``rate`` Hz (and one channel, the mean of its channels, if ``mono``): what an engine
    hands its model (e.g. 16 kHz mono for Whisper and Qwen2.5-Omni)."""
    import av

    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    samples = np.asarray(clip.samples, dtype=np.float32)
    if samples.ndim == 1:
        samples = samples[np.newaxis, :]
    if mono and samples.shape[0] > 1:
        samples = samples.mean(axis=0, keepdims=True)
    if rate == clip.sample_rate:
        return AudioClip(np.ascontiguousarray(samples), rate)
    channels = samples.shape[0]
    layout = {1: "mono", 2: "stereo"}.get(channels, f"{channels}c")
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp", layout=layout)
    frame.sample_rate = clip.sample_rate
    frame.pts = 0
    frame.time_base = Fraction(1, clip.sample_rate)
    out = [f.to_ndarray() for f in (*resampler.resample(frame), *resampler.resample(None))]
    result = np.concatenate(out, axis=1) if out else np.zeros((channels, 0), np.float32)
    return AudioClip(np.ascontiguousarray(result, dtype=np.float32), rate)


# --- video ---
class VideoReader:
    """The first video stream of ``data``, checked against ``limits`` from its header on opening and
    frame by frame as ``frames()`` decodes it. A context manager (it holds the open file)."""

    def __init__(self, data: bytes, limits: MediaLimits | None = None) -> None:
        self.limits = limits or MediaLimits()
        self._container = _open(data, "video")
        try:
            self._stream = _video_stream(self._container)
            self._inspect(data)
        except BaseException:
            self._container.close()
            raise
        self.decoded = 0
        self.resized = False
        """A frame came at another size than the first (it was scaled to the first's size)."""

    def _inspect(self, data: bytes) -> None:
        stream, limits = self._stream, self.limits
        context = stream.codec_context
        self.codec = context.name
        self.pix_fmt = context.pix_fmt or ""
        self.format_name = self._container.format.name
        self.width, self.height = int(context.width or 0), int(context.height or 0)
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        self.fps = float(rate) if rate else 0.0
        if not self.fps > 0:
            raise MediaError("declares no frame rate")
        if self.width <= 0 or self.height <= 0:
            raise MediaError(f"declares no frame size ({self.width}x{self.height})")
        self._check_pixels(self.width, self.height)
        self.declared_s = _declared_seconds(self._container, stream, data)
        _check_declared(self.declared_s, limits)
        self.declared_frames = int(stream.frames or 0) or None
        if self.declared_frames and limits.max_frames is not None and self.declared_frames > limits.max_frames:
            raise MediaError(f"has {self.declared_frames:,} frames (as its header says); at most "
                             f"{limits.max_frames:,}{_setting(limits.frames_setting)}")

    def _check_pixels(self, width: int, height: int) -> None:
        most = self.limits.max_pixels
        if most is not None and width * height > most:
            raise MediaError(f"has {width}x{height} frames ({width * height:,} pixels); at most {most:,} pixels a "
                             f"frame{_setting(self.limits.pixels_setting)}")

    def frames(self) -> Iterator[np.ndarray]:
        """Each frame as uint8 RGB [height, width, 3] at the first frame's size, counted against the limits;
        at the end, a file that decoded short of its declared length is refused (truncated)."""
        import av

        limits = self.limits
        try:
            for frame in (f for packet in self._container.demux(self._stream) for f in self._stream.decode(packet)):
                self._check_pixels(frame.width, frame.height)
                if self.decoded == 0:
                    self.width, self.height = frame.width, frame.height
                elif (frame.width, frame.height) != (self.width, self.height):
                    self.resized = True
                self.decoded += 1
                if limits.max_frames is not None and self.decoded > limits.max_frames:
                    raise MediaError(f"has more than {limits.max_frames:,} frames (counted as it decoded, whatever "
                                     f"its header says){_setting(limits.frames_setting)}")
                if limits.max_seconds is not None and self.decoded / self.fps > limits.max_seconds:
                    raise MediaError(f"is longer than {_seconds(limits.max_seconds)} (counted as it decoded, "
                                     f"whatever its header says){_setting(limits.seconds_setting)}")
                yield frame.to_ndarray(format="rgb24", width=self.width, height=self.height)
        except av.error.FFmpegError as exc:
            raise MediaError(f"cannot be decoded as video (damaged or truncated?): {_reason(exc)}") from None
        if not self.decoded:
            raise MediaError("holds no video frames")
        declared = self.declared_frames
        if declared and self.decoded + max(2, declared // 100) < declared:
            raise MediaError(f"is truncated or damaged: its header says {declared:,} frames, but only "
                             f"{self.decoded:,} decode")
        if not declared:
            _check_truncated(self.declared_s, self.decoded / self.fps)

    def close(self) -> None:
        self._container.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def decode_video(data: bytes, limits: MediaLimits | None = None) -> VideoClip:
    """uint8 frames [n, height, width, 3] and the frame rate of the first video stream of ``data``."""
    with VideoReader(data, limits) as reader:
        frames = list(reader.frames())
        return VideoClip(np.stack(frames), reader.fps)
