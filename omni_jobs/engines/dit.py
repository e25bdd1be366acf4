"""The diffusion-transformer (DiT) engine: a diffusers pipeline that batches compatible requests.

One engine wraps any diffusers pipeline class: text-to-image (PixArt, Chroma...), image-to-image
(Chroma img2img...), text-to-audio (StableAudio) and text-to-video (Wan). A request is conditioned
either on a text prompt, which the pipeline's own text encoder embeds, or on ``prompt_embeds`` made
upstream (an LLM's hidden states: the Qwen-Image / BAGEL pattern). What the loaded pipeline can do is read from
its call signature and components, so a stage asking for something it cannot do fails clearly.

Requests that share every call-level setting go into one pipeline call with one
``torch.Generator`` per request, so each output depends only on its own seed (within float noise
of the single call). A request may ask for previews of its latents every ``preview_every`` steps
(omni_jobs.media.previews): the engine hands a CPU copy of that member's latents to the request's
``on_preview``; projecting and encoding them is the receiver's business, off this thread. torch and
diffusers are imported lazily in the constructor.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from omni_jobs.core import telemetry
from omni_jobs.core.json_types import JsonValue
from omni_jobs.engines.turns import engine_turn, pass_turn, taking_turns
from omni_jobs.media.previews import LatentPreview, LatentProjection, fit_projection, one_frame, spatial_latents
from omni_jobs.pipelines.model_info import DIT_EMBED_KEYS

if TYPE_CHECKING:
    import PIL.Image
    import torch

log = logging.getLogger(__name__)

StepCallback = Callable[[int, int], None]
"""``(steps_done, total_steps)`` across the whole ``generate`` call; may raise to abort it."""
PreviewCallback = Callable[[LatentPreview], None]
"""Receives one request's latents at a preview step; must not block (it runs on the engine's thread)."""


@dataclass(frozen=True)
class DiTRequest:
    """One generation. Exactly one of ``prompt`` / ``prompt_embeds`` conditions it.

    Images: ``height`` x ``width`` (for image-to-image None means the input image's size, rounded
    to what the model takes). Image-to-image: ``image`` and ``strength``. Audio: ``duration_s``.
    Video: ``num_frames`` of ``height`` x ``width``.
    """

    request_id: str
    prompt: str | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int = 8
    guidance_scale: float = 4.5
    seed: int = 0
    negative_prompt: str | None = None
    prompt_embeds: torch.Tensor | None = None
    """[tokens, embedding size] from an upstream stage (e.g. an LLM's hidden states)."""
    image: PIL.Image.Image | None = None
    strength: float | None = None
    duration_s: float | None = None
    want_latents: bool = False
    """Also return the final latents (what the VAE decodes), captured at the last denoising step."""
    num_frames: int | None = None
    preview_every: int = 0
    """Hand ``on_preview`` this request's latents every that many steps (not at the last); 0: never."""
    on_preview: PreviewCallback | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_embeds is None):
            raise ValueError(f"request {self.request_id!r}: give exactly one of prompt and prompt_embeds")
        if self.prompt_embeds is not None and self.prompt_embeds.ndim != 2:
            raise ValueError(
                f"request {self.request_id!r}: prompt_embeds must be [tokens, dim], got {list(self.prompt_embeds.shape)}"
            )
        if (self.height is not None and self.height < 1) or (self.width is not None and self.width < 1):
            raise ValueError(f"request {self.request_id!r}: height and width must be positive")
        if self.num_inference_steps < 1:
            raise ValueError(f"request {self.request_id!r}: num_inference_steps must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"request {self.request_id!r}: duration_s must be positive")
        if self.image is not None and self.strength is None:
            raise ValueError(f"request {self.request_id!r}: an image-to-image request needs a strength")
        if self.num_frames is not None and self.num_frames < 1:
            raise ValueError(f"request {self.request_id!r}: num_frames must be >= 1")
        if self.preview_every < 0:
            raise ValueError(f"request {self.request_id!r}: preview_every must be >= 0")

    @property
    def is_audio(self) -> bool:
        return self.duration_s is not None

    @property
    def is_video(self) -> bool:
        return self.num_frames is not None

    def previews_at(self, step: int) -> bool:
        """Whether this request wants a preview after denoising step ``step`` (1-based)."""
        return (self.on_preview is not None and self.preview_every > 0 and step % self.preview_every == 0
                and step < self.denoising_steps)

    @property
    def denoising_steps(self) -> int:
        """Steps the pipeline will run: image-to-image skips the first (1 - strength) of the schedule."""
        if self.strength is None:
            return self.num_inference_steps
        n = self.num_inference_steps
        return n - int(max(n - n * self.strength, 0))


@dataclass(frozen=True)
class DiTOutput:
    request_id: str
    image: PIL.Image.Image | None = None
    audio: np.ndarray | None = None
    """float32 samples in [-1, 1] shaped [channels, n]."""
    sample_rate: int | None = None
    latents: torch.Tensor | None = None
    video: np.ndarray | None = None
    """float32 frames in [0, 1] shaped [frames, height, width, 3]."""


class DiTLikeEngine(Protocol):
    """What the DiT batcher and a DiT stage use of an engine: DiTEngine, and the benchmark's GPU-shaped
    stand-in (omni_jobs.engines.gpu_shaped), which takes the same requests behind the same batcher."""

    pipeline_class: str

    def generate(self, requests: Sequence[DiTRequest], on_step: StepCallback | None = None) -> list[DiTOutput]: ...

    def turn(self) -> AbstractContextManager[None]: ...

    def check_task(self, task: str, *, conditioned_on_embeds: bool = False) -> None: ...


GroupKey = tuple[int | None, int | None, int, float, str | None, float | None, float | None, tuple[int, ...] | None,
                 bool, int | None]
"""(height, width, steps, guidance, negative prompt, strength, duration, embeddings' shape, latents wanted, frames)."""


def group_key(r: DiTRequest) -> GroupKey:
    """The call settings a request shares with the others in one diffusers call (the batcher's grouping key)."""
    embeds_shape = tuple(r.prompt_embeds.shape) if r.prompt_embeds is not None else None
    return (r.height, r.width, r.num_inference_steps, r.guidance_scale, r.negative_prompt, r.strength, r.duration_s,
            embeds_shape, r.want_latents, r.num_frames)


def _group(requests: Sequence[DiTRequest]) -> dict[GroupKey, list[int]]:
    """Request indices by call settings, groups in order of first appearance."""
    groups: dict[GroupKey, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(group_key(r), []).append(i)
    return groups


def resolve_device(device: str) -> str:
    """``auto``: CUDA where torch sees a GPU, else the CPU; any other name as given."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _dtype_kwarg() -> str:
    """Newer diffusers take ``dtype`` and deprecate ``torch_dtype``; older ones know only ``torch_dtype``."""
    from diffusers.pipelines import pipeline_utils

    return "dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"


_load_lock = threading.Lock()


@contextlib.contextmanager
def _fp32_load(model: str, dtype: torch.dtype) -> Iterator[None]:
    """Let a float32 load through where diffusers would refuse it for want of ``accelerate``.

    Models that keep some modules in float32 when loaded in half precision (Wan's transformer:
    ``_keep_in_fp32_modules``) can only be loaded with ``low_cpu_mem_usage``, which needs the
    ``accelerate`` package. In float32 every module is float32 already, so that setting changes
    nothing: it is lifted for the load (of the classes this model's model_index.json names)."""
    import diffusers
    import torch
    from diffusers.utils.import_utils import is_accelerate_available

    index = Path(model) / "model_index.json"
    if dtype is not torch.float32 or is_accelerate_available() or not index.is_file():  # type: ignore[no-untyped-call]  # accelerate leaves is_accelerate_available untyped
        yield
        return
    classes = []
    for entry in json.loads(index.read_text()).values():
        if isinstance(entry, list) and len(entry) == 2 and entry[0] == "diffusers" and isinstance(entry[1], str):
            cls = getattr(diffusers, entry[1], None)
            if cls is not None and getattr(cls, "_keep_in_fp32_modules", None):
                classes.append((cls, cls.__dict__.get("_keep_in_fp32_modules")))
    with _load_lock:
        for cls, _ in classes:
            cls._keep_in_fp32_modules = None
        try:
            yield
        finally:
            for cls, kept in classes:
                cls._keep_in_fp32_modules = kept


class DiTEngine:
    """One diffusers pipeline, loaded once, called with batches of requests."""

    def __init__(
        self,
        model: str,
        *,
        pipeline_class: str | None = None,
        torch_dtype: str = "float32",
        device: str = "auto",
        call_args: Mapping[str, JsonValue] | None = None,
        load_args: Mapping[str, JsonValue] | None = None,
        cache: Mapping[str, JsonValue] | None = None,
    ) -> None:
        """``call_args``: extra keyword arguments of every pipeline call; ``load_args``: of
        ``from_pretrained``; ``cache``: a denoising cache (``{type, ...}``, see DenoiseCacheSpec)."""
        import diffusers
        import torch

        dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        if torch_dtype not in dtypes:
            raise ValueError(f"torch_dtype must be one of {sorted(dtypes)}, got {torch_dtype!r}")
        dtype = dtypes[torch_dtype]
        # The pipeline's class is chosen at run time, and so are its components (transformer, vae) and
        # call signature: the pipeline object is typed Any.
        cls: Any = diffusers.DiffusionPipeline
        if pipeline_class is not None:
            cls = getattr(diffusers, pipeline_class, None)
            if cls is None:
                raise ValueError(f"diffusers has no pipeline class {pipeline_class!r}")
        self.model = model
        self.device = resolve_device(device)
        load = {_dtype_kwarg(): dtype, **dict(load_args or {})}
        with _fp32_load(model, dtype):
            self.pipe = cls.from_pretrained(model, **load).to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        self.pipeline_class = type(self.pipe).__name__
        self._params = set(inspect.signature(self.pipe.__call__).parameters)
        self._call_args: dict[str, object] = {**self._default_call_args(), **dict(call_args or {})}
        self._lock = threading.RLock()  # pipelines keep per-call state (scheduler timesteps)
        self._pixart_encoding = self._pixart_encode_defaults()
        self._negatives: dict[str | None, tuple[Any, Any]] = {}  # negative prompt -> its embeddings, mask (batch 1)
        self.cache_type: str | None = None
        self._projection: LatentProjection | None = None
        self._projection_tried = False
        if cache:
            self._enable_denoising_cache(dict(cache))

    def _enable_denoising_cache(self, cache: dict[str, JsonValue]) -> None:
        """Turn on a diffusers built-in denoising cache on the transformer (first_block, faster, pab)."""
        from diffusers.hooks.faster_cache import FasterCacheConfig, apply_faster_cache
        from diffusers.hooks.first_block_cache import FirstBlockCacheConfig, apply_first_block_cache
        from diffusers.hooks.pyramid_attention_broadcast import (
            PyramidAttentionBroadcastConfig,
            apply_pyramid_attention_broadcast,
        )

        kind = cache.pop("type", None)
        # The config class's own keyword arguments, as the YAML gives them (DenoiseCacheSpec lets any through).
        options: dict[str, Any] = {k: v for k, v in cache.items() if v is not None}
        transformer = getattr(self.pipe, "transformer", None)
        if transformer is None:
            raise ValueError(f"engine_args.cache: {self.pipeline_class} has no transformer to cache")
        pipe = self.pipe

        def timestep() -> int:
            current = getattr(pipe, "_current_timestep", None) or getattr(pipe, "current_timestep", None)
            return int(current) if current is not None else 500

        config: FirstBlockCacheConfig | FasterCacheConfig | PyramidAttentionBroadcastConfig
        if kind == "first_block":
            config = FirstBlockCacheConfig(**options)
        elif kind == "faster":
            config = FasterCacheConfig(**{"current_timestep_callback": timestep, **options})
        elif kind == "pab":
            options.setdefault("spatial_attention_block_skip_range", 2)
            config = PyramidAttentionBroadcastConfig(**{"current_timestep_callback": timestep, **options})
        else:
            raise ValueError(f"engine_args.cache.type must be first_block, faster or pab, got {kind!r}")
        if hasattr(transformer, "enable_cache"):
            transformer.enable_cache(config)
        elif isinstance(config, FirstBlockCacheConfig):
            apply_first_block_cache(transformer, config)
        elif isinstance(config, FasterCacheConfig):
            apply_faster_cache(transformer, config)
        else:
            apply_pyramid_attention_broadcast(transformer, config)
        self.cache_type = kind

    # --- what the loaded pipeline can do ---
    @property
    def makes_audio(self) -> bool:
        return "audio_end_in_s" in self._params

    @property
    def makes_video(self) -> bool:
        return "num_frames" in self._params

    @property
    def takes_image(self) -> bool:
        return "image" in self._params and not self.makes_audio

    @property
    def takes_prompt_embeds(self) -> bool:
        return "prompt_embeds" in self._params

    @property
    def has_text_encoder(self) -> bool:
        return getattr(self.pipe, "text_encoder", None) is not None

    @property
    def prompt_embed_dim(self) -> int | None:
        """The prompt-embedding size the transformer takes (from its config), when it says."""
        config = getattr(getattr(self.pipe, "transformer", None), "config", None) or {}
        for key in DIT_EMBED_KEYS:
            value = config.get(key) if hasattr(config, "get") else None
            if isinstance(value, int):
                return value
        return None

    @property
    def sample_rate(self) -> int | None:
        vae = getattr(self.pipe, "vae", None)
        rate = getattr(getattr(vae, "config", None), "sampling_rate", None)
        return int(rate) if rate else None

    @property
    def max_duration_s(self) -> float | None:
        """The longest clip an audio pipeline makes (latent length x hop length / sample rate)."""
        vae = getattr(self.pipe, "vae", None)
        size = getattr(getattr(getattr(self.pipe, "transformer", None), "config", None), "sample_size", None)
        hop, rate = getattr(vae, "hop_length", None), self.sample_rate
        if not (self.makes_audio and size and hop and rate):
            return None
        return float(size * hop / rate)

    @property
    def size_multiple(self) -> int:
        """Image sides must be multiples of this (VAE factor, times 2 for pipelines that pack latents)."""
        processor = getattr(self.pipe, "image_processor", None) or getattr(self.pipe, "video_processor", None)
        factor = getattr(getattr(processor, "config", None), "vae_scale_factor", None)
        return int(factor) if factor else 8

    @property
    def frame_multiple(self) -> int:
        """A video's frame count minus one must be a multiple of this (the VAE's temporal factor)."""
        return int(getattr(self.pipe, "vae_scale_factor_temporal", None) or 1)

    def check_task(self, task: str, *, conditioned_on_embeds: bool = False) -> None:
        """Raise ValueError saying why this pipeline cannot run ``task`` as the stage wires it."""
        where = f"model {self.model!r} ({self.pipeline_class})"
        if task == "text-to-audio" and not self.makes_audio:
            raise ValueError(f"{where} does not make audio; use a text-to-audio pipeline class (StableAudioPipeline)")
        if task != "text-to-audio" and self.makes_audio:
            raise ValueError(f"{where} makes audio, not images; set task: text-to-audio")
        if task == "text-to-video" and not self.makes_video:
            raise ValueError(f"{where} does not make video; use a text-to-video pipeline class (WanPipeline)")
        if task != "text-to-video" and self.makes_video:
            raise ValueError(f"{where} makes video, not images; set task: text-to-video")
        if task == "image-to-image" and not self.takes_image:
            raise ValueError(
                f"{where} takes no input image; set engine_args.pipeline_class to an image-to-image class "
                "(e.g. ChromaImg2ImgPipeline)"
            )
        if task == "text-to-image" and "image" in self._params and "strength" in self._params:
            raise ValueError(f"{where} is an image-to-image pipeline; set task: image-to-image")
        if conditioned_on_embeds and not self.takes_prompt_embeds:
            raise ValueError(f"{where} cannot be called with prompt_embeds")
        if not conditioned_on_embeds and not self.has_text_encoder:
            raise ValueError(f"{where} has no text encoder; wire prompt_embeds from an AR encode stage instead of text")

    def _default_call_args(self) -> dict[str, bool]:
        """Defaults that make small sizes work and outputs independent of optional packages."""
        defaults: dict[str, bool] = {}
        if "use_resolution_binning" in self._params:
            defaults["use_resolution_binning"] = False  # else PixArt snaps 32x32 to its aspect-ratio bins
        if "clean_caption" in self._params:
            defaults["clean_caption"] = False  # its result depends on whether bs4/ftfy are installed
        return defaults

    def _pixart_encode_defaults(self) -> dict[str, object] | None:
        """For a PixArt pipeline (Alpha, Sigma), what its call would hand its ``encode_prompt`` where the
        call's arguments do not say; None for any other (Chroma's ``encode_prompt``, say, returns six
        values). With PixArt the engine encodes prompts itself and each negative prompt once, where the
        pipeline would encode it again for every member of every batch (an empty negative through T5:
        half a batch's text encoding, 90-100 ms of a 32-image batch here)."""
        import diffusers

        pixart = tuple(c for c in (getattr(diffusers, n, None) for n in ("PixArtAlphaPipeline", "PixArtSigmaPipeline"))
                       if c is not None)
        if not pixart or not isinstance(self.pipe, pixart):
            return None
        call = inspect.signature(self.pipe.__call__).parameters
        takes = inspect.signature(self.pipe.encode_prompt).parameters
        return {k: call[k].default for k in ("clean_caption", "max_sequence_length") if k in call and k in takes}

    # --- generation ---
    def _resolve_size(self, r: DiTRequest) -> DiTRequest:
        """Image-to-image without a size: the input image's, rounded down to what the model takes."""
        if r.image is None or (r.height is not None and r.width is not None):
            return r
        from dataclasses import replace

        m = self.size_multiple
        height = r.height or max(m, r.image.height // m * m)
        width = r.width or max(m, r.image.width // m * m)
        return replace(r, height=height, width=width)

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """This engine to itself and its turn on shared cores, in the order ``generate`` takes them (a
        batcher waits for both before its batch is final; reentrant within a thread)."""
        with self._lock, engine_turn():
            yield

    def generate(self, requests: Sequence[DiTRequest], on_step: StepCallback | None = None) -> list[DiTOutput]:
        """Run every request; one pipeline call per group of compatible requests, results in order."""
        if not requests:
            return []
        requests = [self._resolve_size(r) for r in requests]
        for r in requests:
            self._check_request(r)
        groups = _group(requests)
        total = sum(requests[indices[0]].denoising_steps for indices in groups.values())
        outputs: dict[int, DiTOutput] = {}
        done = 0
        with self._lock:
            if any(r.preview_every and r.on_preview for r in requests):
                self._fit_projection()
            telemetry.batch("dit", len(requests))
            for indices in groups.values():
                batch = [requests[i] for i in indices]
                for i, output in zip(indices, self._call(batch, done, total, on_step), strict=True):
                    outputs[i] = output
                done += batch[0].denoising_steps
        return [outputs[i] for i in range(len(requests))]

    def _fit_projection(self) -> None:
        """The latent -> RGB projection of this pipeline's VAE, fitted once (omni_jobs.media.previews)."""
        if self._projection_tried:
            return
        self._projection_tried = True
        try:
            self._projection = fit_projection(self.pipe)
        except Exception:  # a preview must never fail a generation
            log.warning("model %s: no latent previews: fitting the projection failed", self.model, exc_info=True)
            return
        if self._projection is None:
            log.warning("model %s (%s): no VAE to fit a preview projection on; no previews", self.model,
                        self.pipeline_class)

    def _check_request(self, r: DiTRequest) -> None:
        kind = "audio" if r.is_audio else "a video" if r.is_video else "an image"
        if r.is_audio != self.makes_audio or r.is_video != self.makes_video:
            raise ValueError(f"request {r.request_id!r} asks for {kind}, but {self.pipeline_class} cannot make it")
        if r.num_frames is not None and (r.num_frames - 1) % self.frame_multiple:
            raise ValueError(
                f"request {r.request_id!r}: num_frames {r.num_frames} must be {self.frame_multiple}k+1 for model "
                f"{self.model!r} (its VAE compresses time {self.frame_multiple}x), e.g. "
                f"{(r.num_frames - 1) // self.frame_multiple * self.frame_multiple + 1}"
            )
        if r.is_video and r.height is not None and r.width is not None:
            patch = getattr(getattr(getattr(self.pipe, "transformer", None), "config", None), "patch_size", None) or 1
            m = self.size_multiple * int(patch[-1] if isinstance(patch, list | tuple) else patch)  # VAE x patches
            if r.height % m or r.width % m:
                raise ValueError(f"request {r.request_id!r}: height and width must be multiples of {m} for model "
                                 f"{self.model!r}, got {r.width}x{r.height}")
        if r.is_audio:
            longest = self.max_duration_s
            if longest is not None and r.duration_s is not None and r.duration_s > longest + 1e-9:
                raise ValueError(
                    f"request {r.request_id!r}: duration_s {r.duration_s:g} is longer than model {self.model!r} "
                    f"makes ({longest:g} s)"
                )
        elif r.height is None or r.width is None:
            raise ValueError(f"request {r.request_id!r}: {kind} request needs height and width")
        if r.prompt_embeds is not None:
            dim = self.prompt_embed_dim
            if dim is not None and r.prompt_embeds.shape[-1] != dim:
                raise ValueError(
                    f"request {r.request_id!r}: prompt embeddings of size {r.prompt_embeds.shape[-1]}, but model "
                    f"{self.model!r} takes {dim}; the LLM's hidden size must match the DiT's prompt-embedding size"
                )

    def _call(
        self, batch: list[DiTRequest], done: int, total: int, on_step: StepCallback | None
    ) -> list[DiTOutput]:
        import torch

        first = batch[0]
        kwargs: dict[str, object] = dict(self._call_args)
        kwargs.update(
            num_inference_steps=first.num_inference_steps,
            guidance_scale=first.guidance_scale,
            # CPU generators: the same seed gives the same noise on any device and in any process.
            generator=[torch.Generator("cpu").manual_seed(r.seed) for r in batch],
        )
        kwargs.update(self._conditioning(batch))
        if first.is_audio:
            kwargs["audio_end_in_s"] = first.duration_s
        elif first.is_video:
            kwargs.update(height=first.height, width=first.width, num_frames=first.num_frames, output_type="np")
        else:
            kwargs.update(height=first.height, width=first.width, output_type="pil")
        if first.image is not None:
            kwargs.update(image=[r.image for r in batch], strength=first.strength)
        captured: list[torch.Tensor | None] = [None]
        previews = batch if self._projection is not None and any(r.preview_every for r in batch) else []
        if on_step is not None or first.want_latents or previews or taking_turns():
            kwargs.update(self._step_hook(done, total, on_step, captured if first.want_latents else None, previews))
        with engine_turn():  # on shared CPU cores, passed on at every step (engines.turns)
            result = self._run_pipe(kwargs)
        latents = captured[0]
        if first.want_latents and latents is None:
            raise RuntimeError(f"{self.pipeline_class} reported no latents to its step callback")
        outputs = []
        for j, r in enumerate(batch):
            lat = latents[j].detach().to("cpu").contiguous() if latents is not None else None
            if first.is_audio:
                audio = result.audios[j]
                samples = audio.detach().to("cpu").float().numpy() if hasattr(audio, "detach") else audio
                outputs.append(DiTOutput(r.request_id, audio=samples, sample_rate=self.sample_rate, latents=lat))
            elif first.is_video:
                frames = np.asarray(result.frames[j], dtype=np.float32)
                outputs.append(DiTOutput(r.request_id, video=frames, latents=lat))
            else:
                outputs.append(DiTOutput(r.request_id, image=result.images[j], latents=lat))
        return outputs

    def _run_pipe(self, kwargs: dict[str, object]) -> Any:
        """One pipeline call; with a denoising cache, inside a cache context that is reset after it
        (the cache's state belongs to one call: the next batch has other prompts and another size).
        Returns the pipeline class's output (``images``, ``audios`` or ``frames``): Any, as the pipeline."""
        if self.cache_type is None:
            return self.pipe(**kwargs)
        from diffusers.hooks.hooks import CacheContext, HookRegistry, _set_cache_context

        transformer = self.pipe.transformer
        _set_cache_context(transformer, CacheContext("cond"))
        try:
            return self.pipe(**kwargs)
        finally:
            _set_cache_context(transformer, None)
            HookRegistry.check_if_exists_or_initialize(transformer).reset_stateful_hooks(recurse=True)

    def _conditioning(self, batch: list[DiTRequest]) -> dict[str, object]:
        """Text prompts for the pipeline's own encoder, or stacked upstream prompt embeddings."""
        import torch

        first = batch[0]
        if first.prompt_embeds is None and self._pixart_encoding is not None and first.guidance_scale > 1:
            return self._text_conditioning(batch, self._pixart_encoding)
        if first.prompt_embeds is None:
            kwargs: dict[str, object] = {"prompt": [r.prompt for r in batch]}
            if first.negative_prompt is not None:
                kwargs["negative_prompt"] = [first.negative_prompt] * len(batch)
            return kwargs
        dtype = getattr(getattr(self.pipe, "transformer", None), "dtype", torch.float32)
        embeds = torch.stack([r.prompt_embeds for r in batch if r.prompt_embeds is not None]).to(self.device, dtype)
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)
        # No text to negate: guidance contrasts with zero embeddings (what an empty prompt maps to
        # in pipelines that zero it out), and the pipeline must not encode a negative text itself.
        kwargs = {"prompt": None, "prompt_embeds": embeds}
        if "negative_prompt" in self._params:
            kwargs["negative_prompt"] = None
        optional = {
            "prompt_attention_mask": mask,
            "negative_prompt_embeds": torch.zeros_like(embeds),
            "negative_prompt_attention_mask": mask,
        }
        kwargs.update({k: v for k, v in optional.items() if k in self._params})
        return kwargs

    def _text_conditioning(self, batch: list[DiTRequest], defaults: dict[str, object]) -> dict[str, object]:
        """The batch's prompts encoded as the pipeline would, and its negative prompt's embeddings from the
        kept ones (encoded on first use; rows of a text encoder do not see each other, so a batch's
        negative rows are the same row repeated)."""
        import torch

        encode_args = {k: self._call_args.get(k, default) for k, default in defaults.items()}
        negative = batch[0].negative_prompt
        with engine_turn(), torch.no_grad():  # inside the pipeline's call the encoding ran in its turn, untracked
            if negative not in self._negatives:
                embeds, mask, _, _ = self.pipe.encode_prompt(negative or "", do_classifier_free_guidance=False,
                                                             num_images_per_prompt=1, device=self.device, **encode_args)
                if len(self._negatives) >= 16:  # the 16 latest: a few negatives recur (most jobs give none)
                    del self._negatives[next(iter(self._negatives))]
                self._negatives[negative] = (embeds, mask)
            embeds, mask, _, _ = self.pipe.encode_prompt([r.prompt for r in batch], do_classifier_free_guidance=False,
                                                         num_images_per_prompt=1, device=self.device, **encode_args)
        negative_embeds, negative_mask = self._negatives[negative]
        n = len(batch)
        return {"prompt": None, "prompt_embeds": embeds, "prompt_attention_mask": mask, "negative_prompt": None,
                "negative_prompt_embeds": negative_embeds.expand(n, -1, -1),
                "negative_prompt_attention_mask": negative_mask.expand(n, -1)}

    def _step_hook(
        self, done: int, total: int, on_step: StepCallback | None, captured: list[torch.Tensor | None] | None,
        previews: Sequence[DiTRequest] = (),
    ) -> dict[str, object]:
        """Wire progress, latent capture and previews to whichever callback API the pipeline has
        (PixArt and StableAudio only have the legacy one)."""

        def step(i: int, latents: torch.Tensor | None) -> None:
            pass_turn()  # another engine of this host may take a step (engines.turns)
            if captured is not None and latents is not None:
                captured[0] = latents.detach().clone()
            if on_step is not None:
                on_step(done + i + 1, total)
            if previews and latents is not None:
                self._hand_previews(previews, i + 1, latents)

        if "callback_on_step_end" in self._params:

            def on_end(pipe: object, i: int, t: object, callback_kwargs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                step(i, callback_kwargs.get("latents"))
                return callback_kwargs

            return {"callback_on_step_end": on_end}
        if "callback" in self._params:

            def legacy(step_idx: int, t: object, latents: torch.Tensor) -> None:
                step(step_idx, latents)

            return {"callback": legacy, "callback_steps": 1}
        return {}

    def _hand_previews(self, batch: Sequence[DiTRequest], step: int, latents: torch.Tensor) -> None:
        """A CPU copy of each wanting member's latents (one frame) to its ``on_preview``; nothing more
        here: the projection and the encoding happen on the receiver's thread."""
        wanting = [(j, r) for j, r in enumerate(batch) if r.previews_at(step)]
        if not wanting or self._projection is None:
            return
        first = batch[0]
        try:
            spatial = spatial_latents(self.pipe, latents, first.height or 0, first.width or 0)
        except ValueError:
            log.warning("model %s: latents shaped %s cannot be previewed", self.model, list(latents.shape))
            return
        for j, r in wanting:
            assert r.on_preview is not None and r.height is not None and r.width is not None
            try:
                r.on_preview(LatentPreview(one_frame(spatial[j]), self._projection, step, r.denoising_steps,
                                           r.width, r.height))
            except Exception:  # a preview must never fail a generation
                log.warning("request %s: preview at step %d failed", r.request_id, step, exc_info=True)
