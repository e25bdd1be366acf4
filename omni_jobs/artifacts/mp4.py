"""Video as MP4 (H.264 in yuv420p, through PyAV): encode frames (all at once, or streamed), copy an H.264
stream into a clean MP4, read frames back, read the header.

The encoder is as deterministic as x264 allows (one thread, lookahead included, fixed settings, no
timestamps in the container): the same frames give the same pictures in any process, and almost
always the same bytes (a full test run still saw them differ now and then). H.264 in yuv420p needs even sides (video
pipelines make multiples of 8 or 16). PyAV is imported only inside the functions.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Self, TypeAlias, TypedDict

import numpy as np
import numpy.typing as npt

from omni_jobs.artifacts.codecs import MEDIA_MP4, CodecError

if TYPE_CHECKING:
    import av.container
    import PIL.Image

__all__ = ["MEDIA_MP4", "Mp4Info", "Mp4Writer", "decode_mp4", "encode_mp4", "mp4_info", "remux_h264"]
CRF = 18
"""x264 quality: visually lossless at this size class; previews of random weights stay recognisable."""


Frames: TypeAlias = "npt.ArrayLike | Sequence[PIL.Image.Image]"
"""Float frames in [0, 1] or uint8 frames shaped [n, height, width, 3], or a list of PIL images."""


def _frames_array(frames: Frames) -> np.ndarray:
    """uint8 [n, height, width, 3] from float frames in [0, 1], uint8 frames, or a list of PIL images."""
    from PIL import Image

    if isinstance(frames, list | tuple) and frames and isinstance(frames[0], Image.Image):
        frames = np.stack([np.asarray(f.convert("RGB")) for f in frames])
    arr = np.asarray(frames)
    if arr.ndim != 4 or arr.shape[-1] != 3 or arr.shape[0] < 1:
        raise CodecError(f"video frames must be [n, height, width, 3] with n >= 1, got {list(arr.shape)}")
    if arr.dtype != np.uint8:
        if not np.isfinite(arr).all():
            raise CodecError("video frames contain NaN or infinite values")
        arr = np.round(np.clip(arr.astype(np.float64), 0.0, 1.0) * 255).astype(np.uint8)
    return arr


def encode_mp4(frames: Frames, fps: float) -> bytes:
    """H.264 MP4 bytes of ``frames`` (see ``_frames_array``) at ``fps`` frames per second."""
    arr = _frames_array(frames)
    with Mp4Writer(fps, width=int(arr.shape[2]), height=int(arr.shape[1])) as writer:
        for frame in arr:
            writer.add(frame)
        return writer.finish()


class Mp4Writer:
    """An H.264 MP4 written a frame at a time with encode_mp4's settings, so that a long video is never
    held whole in memory (a job's video input, re-encoded as it decodes). A context manager: leaving
    it unfinished closes the encoder."""

    def __init__(self, fps: float, *, width: int, height: int) -> None:
        import av

        if not fps or fps <= 0:
            raise CodecError(f"fps must be positive, got {fps!r}")
        if height % 2 or width % 2:
            raise CodecError(f"H.264 (yuv420p) needs even sides, got {width}x{height}")
        self.width, self.height = width, height
        self.frames = 0
        self._buffer = io.BytesIO()
        self._container = av.open(self._buffer, mode="w", format="mp4")
        stream = self._container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        # One encoder thread, lookahead included: libavcodec's "threads" alone leaves x264 a lookahead
        # thread, and then about 1 encode in 60 differs (measured), so the same frames gave other bytes.
        stream.codec_context.options = {"crf": str(CRF), "preset": "medium", "threads": "1",
                                        "x264-params": "threads=1:lookahead-threads=1:sliced-threads=0"}
        stream.codec_context.thread_count = 1
        self._container.metadata.clear()
        self._stream = stream

    def add(self, frame: np.ndarray) -> None:
        """One uint8 RGB frame [height, width, 3] of the writer's size."""
        import av

        if frame.shape != (self.height, self.width, 3) or frame.dtype != np.uint8:
            raise CodecError(f"a frame must be uint8 [{self.height}, {self.width}, 3], got {frame.dtype} "
                             f"{list(frame.shape)}")
        video_frame = av.VideoFrame.from_ndarray(frame, format="rgb24")
        video_frame.pts = self.frames
        self.frames += 1
        for packet in self._stream.encode(video_frame):
            self._container.mux(packet)

    def finish(self) -> bytes:
        """The MP4's bytes (at least one frame must have been added)."""
        if not self.frames:
            self._container.close()
            raise CodecError("an MP4 needs at least one frame")
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._buffer.getvalue()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._container.close()  # a second close does nothing


def remux_h264(data: bytes) -> bytes:
    """The first video stream of ``data`` (H.264, in MP4 or MOV) alone in a new MP4 without metadata,
    its packets copied as they are: the stored form of a video input that is H.264 already, at no
    re-encoding's cost. CodecError if that stream is not H.264."""
    import av

    source = _open(data)
    buffer = io.BytesIO()
    try:
        video = source.streams.video[0]
        if video.codec_context.name != "h264":
            raise CodecError(f"remux_h264 copies H.264, got {video.codec_context.name}")
        with av.open(buffer, mode="w", format="mp4") as target:
            target.metadata.clear()
            stream = target.add_stream_from_template(video)
            stream.metadata.clear()
            for packet in source.demux(video):
                if packet.dts is None:  # the demuxer's end-of-stream packet
                    continue
                packet.stream = stream
                target.mux(packet)
    except av.error.FFmpegError as exc:
        raise CodecError(f"cannot copy the video stream: {exc}") from exc
    finally:
        source.close()
    return buffer.getvalue()


def _open(data: bytes) -> av.container.InputContainer:
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError) as exc:
        raise CodecError(f"not a video ({len(data)} bytes): {exc}") from exc
    if "mp4" not in container.format.name.split(","):
        name = container.format.name
        container.close()
        raise CodecError(f"expected MP4, got {name}")
    if not container.streams.video:
        container.close()
        raise CodecError("the file has no video stream")
    return container


def decode_mp4(data: bytes) -> tuple[np.ndarray, float]:
    """All frames as uint8 [n, height, width, 3] and the frame rate."""
    container = _open(data)
    try:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        fps = float(stream.average_rate or stream.base_rate or 0)
    finally:
        container.close()
    return np.stack(frames), fps


class Mp4Info(TypedDict):
    frames: int
    fps: float
    duration_s: float
    width: int
    height: int


def mp4_info(data: bytes) -> Mp4Info:
    """Frames, fps, duration (frames / fps), width and height of a video, from its header."""
    container = _open(data)
    try:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.base_rate or 0)
        frames = int(stream.frames or 0) or sum(1 for _ in container.demux(stream) if _.size)
        width, height = stream.codec_context.width, stream.codec_context.height
    finally:
        container.close()
    return {"frames": frames, "fps": fps, "duration_s": frames / fps if fps else 0.0, "width": width,
            "height": height}
