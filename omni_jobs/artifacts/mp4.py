"""Video as MP4 (H.264 in yuv420p, through PyAV): encode frames, read them back, read the header.

The encoder is as deterministic as x264 allows (one thread, lookahead included, fixed settings, no
timestamps in the container): the same frames give the same pictures in any process, and almost
always the same bytes (a full test run still saw them differ now and then). H.264 in yuv420p needs even sides (video
pipelines make multiples of 8 or 16). PyAV is imported only inside the functions.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, TypeAlias, TypedDict

import numpy as np
import numpy.typing as npt

from omni_jobs.artifacts.codecs import MEDIA_MP4, CodecError

if TYPE_CHECKING:
    import av.container
    import PIL.Image

__all__ = ["MEDIA_MP4", "Mp4Info", "decode_mp4", "encode_mp4", "mp4_info"]
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
    import av

    if not fps or fps <= 0:
        raise CodecError(f"fps must be positive, got {fps!r}")
    arr = _frames_array(frames)
    n, height, width, _ = arr.shape
    if height % 2 or width % 2:
        raise CodecError(f"H.264 (yuv420p) needs even sides, got {width}x{height}")
    rate = Fraction(fps).limit_denominator(1001)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        # One encoder thread, lookahead included: libavcodec's "threads" alone leaves x264 a lookahead
        # thread, and then about 1 encode in 60 differs (measured), so the same frames gave other bytes.
        stream.codec_context.options = {"crf": str(CRF), "preset": "medium", "threads": "1",
                                        "x264-params": "threads=1:lookahead-threads=1:sliced-threads=0"}
        stream.codec_context.thread_count = 1
        container.metadata.clear()
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(arr[i], format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()


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
