"""The diffusion-transformer (DiT) engine: a diffusers pipeline that batches compatible requests.

Requests that share every call-level setting (size, steps, guidance, negative prompt) go into one
pipeline call with one ``torch.Generator`` per request, so each image depends only on its own seed
(within float noise of the single call). torch and diffusers are imported lazily in the constructor.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import PIL.Image

StepCallback = Callable[[int, int], None]
"""``(steps_done, total_steps)`` across the whole ``generate`` call; may raise to abort it."""


@dataclass(frozen=True)
class DiTRequest:
    request_id: str
    prompt: str
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    negative_prompt: str | None = None

    def __post_init__(self) -> None:
        if self.height < 1 or self.width < 1:
            raise ValueError(f"request {self.request_id!r}: height and width must be positive")
        if self.num_inference_steps < 1:
            raise ValueError(f"request {self.request_id!r}: num_inference_steps must be >= 1")


@dataclass(frozen=True)
class DiTOutput:
    request_id: str
    image: PIL.Image.Image


_GroupKey = tuple[int, int, int, float, str | None]


def _group_key(r: DiTRequest) -> _GroupKey:
    return (r.height, r.width, r.num_inference_steps, r.guidance_scale, r.negative_prompt)


def _group(requests: Sequence[DiTRequest]) -> dict[_GroupKey, list[int]]:
    """Request indices by call settings, groups in order of first appearance."""
    groups: dict[_GroupKey, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(_group_key(r), []).append(i)
    return groups


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _dtype_kwarg() -> str:
    """Newer diffusers take ``dtype`` and deprecate ``torch_dtype``; older ones know only ``torch_dtype``."""
    from diffusers.pipelines import pipeline_utils

    return "dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"


class DiTEngine:
    """One diffusers pipeline, loaded once, called with batches of requests."""

    def __init__(
        self,
        model: str,
        *,
        pipeline_class: str | None = None,
        torch_dtype: str = "float32",
        device: str = "auto",
        call_args: Mapping[str, Any] | None = None,
        load_args: Mapping[str, Any] | None = None,
    ) -> None:
        import diffusers
        import torch

        dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        if torch_dtype not in dtypes:
            raise ValueError(f"torch_dtype must be one of {sorted(dtypes)}, got {torch_dtype!r}")
        dtype = dtypes[torch_dtype]
        cls: Any = diffusers.DiffusionPipeline
        if pipeline_class is not None:
            cls = getattr(diffusers, pipeline_class, None)
            if cls is None:
                raise ValueError(f"diffusers has no pipeline class {pipeline_class!r}")
        self.model = model
        self.device = _resolve_device(device)
        load = {_dtype_kwarg(): dtype, **dict(load_args or {})}
        self.pipe = cls.from_pretrained(model, **load).to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        self._params = set(inspect.signature(self.pipe.__call__).parameters)
        self._call_args = {**self._default_call_args(), **dict(call_args or {})}
        self._lock = threading.Lock()  # pipelines keep per-call state (scheduler timesteps)

    def _default_call_args(self) -> dict[str, Any]:
        """Defaults that make small sizes work and outputs independent of optional packages."""
        defaults: dict[str, Any] = {}
        if "use_resolution_binning" in self._params:
            defaults["use_resolution_binning"] = False  # else PixArt snaps 32x32 to its aspect-ratio bins
        if "clean_caption" in self._params:
            defaults["clean_caption"] = False  # its result depends on whether bs4/ftfy are installed
        return defaults

    def generate(self, requests: Sequence[DiTRequest], on_step: StepCallback | None = None) -> list[DiTOutput]:
        """Render every request; one pipeline call per group of compatible requests, results in order."""
        if not requests:
            return []
        groups = _group(requests)
        total = sum(key[2] for key in groups)
        images: dict[int, PIL.Image.Image] = {}
        done = 0
        with self._lock:
            for key, indices in groups.items():
                batch = [requests[i] for i in indices]
                for i, image in zip(indices, self._call(batch, done, total, on_step), strict=True):
                    images[i] = image
                done += key[2]
        return [DiTOutput(request_id=r.request_id, image=images[i]) for i, r in enumerate(requests)]

    def _call(
        self, batch: list[DiTRequest], done: int, total: int, on_step: StepCallback | None
    ) -> list[PIL.Image.Image]:
        import torch

        first = batch[0]
        kwargs: dict[str, Any] = dict(self._call_args)
        kwargs.update(
            prompt=[r.prompt for r in batch],
            height=first.height,
            width=first.width,
            num_inference_steps=first.num_inference_steps,
            guidance_scale=first.guidance_scale,
            # CPU generators: the same seed gives the same noise on any device and in any process.
            generator=[torch.Generator("cpu").manual_seed(r.seed) for r in batch],
            output_type="pil",
        )
        if first.negative_prompt is not None:
            kwargs["negative_prompt"] = [first.negative_prompt] * len(batch)
        if on_step is not None:
            kwargs.update(self._step_hook(done, total, on_step))
        result = self.pipe(**kwargs)
        return list(result.images)

    def _step_hook(self, done: int, total: int, on_step: StepCallback) -> dict[str, Any]:
        """Wire ``on_step`` to whichever callback API the pipeline has (PixArt only has the legacy one)."""
        if "callback_on_step_end" in self._params:

            def on_end(pipe: Any, i: int, t: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
                on_step(done + i + 1, total)
                return callback_kwargs

            return {"callback_on_step_end": on_end}
        if "callback" in self._params:

            def legacy(step_idx: int, t: Any, latents: Any) -> None:
                on_step(done + step_idx + 1, total)

            return {"callback": legacy, "callback_steps": 1}
        return {}
