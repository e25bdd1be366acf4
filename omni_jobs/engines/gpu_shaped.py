"""A GPU-shaped DiT engine, for the benchmark only: a diffusion model on a GPU, as the CPU sees it.

On a GPU host the engine thread of a DiT worker spends most of a batch waiting for the device, with
the interpreter's lock released, and a small share holding it: the CPU-side work (kernel launches,
the tokenizer, preparing tensors). Issue 61 judges the job system there, where the engine needs
little CPU but does need the lock at the right moments, on machines without a GPU. This engine
reproduces that shape, per batch and step by step:

* the CPU side: ``gil_share`` of the batch's time spent as CPU time of this thread in small numpy
  operations and Python (they hold the lock, as launches do). It is counted in this thread's CPU
  time, not wall time, so that other threads holding the lock or taking the cores make it longer,
  as they make a real engine's launches longer;
* the device: the rest as a sleep, which releases the lock. A GPU does not share the CPU's cores,
  so this part takes no engine turn (omni_jobs.engines.turns; turns are off on a GPU host anyway)
  and is not slowed by whatever else the machine runs. The CPU side takes no turn either: on a GPU
  host no CPU engine shares the cores with it.

The two alternate within each denoising step (the launches of a step, then its kernels): serial,
not overlapped, which is what the H200's profile showed (the GPU waited whenever the CPU side was
slow: its share went from 6% alone to 24% in the worker). A batch of ``n`` takes
``full * (fixed_share + (1 - fixed_share) * n / batch_size)``, where ``full`` is ``ms_per_image *
batch_size``: a smaller batch costs more per image, as on the device (one image alone took 6.25x its
share of a batch of 32 on the H200), so the batcher's burst filling sees the cost curve it sees
there. Size and steps change the outputs and how often progress is reported, not the time. Not modelled:
a real engine releases the lock around every torch op (hundreds a step) and takes it back each time, where
this one releases it once a step, so it may suffer less from a busy lock than a real engine does.

Its outputs are real images of the requested size, deterministic from the request's seed and prompt
(a cheap pattern, made within the CPU-side share), so PNG encoding, artifact writes, commits,
progress and previews all run as with the diffusers engine. It takes the same requests and gives
the same outputs (omni_jobs.engines.dit), behind the same batcher. A stage uses it only when its
engine_args name ``kind: gpu-shaped`` (GpuShapedArgs); no built-in pipeline does.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from omni_jobs.core import telemetry
from omni_jobs.core.json_types import JsonValue
from omni_jobs.engines.dit import DiTOutput, DiTRequest, StepCallback, group_key
from omni_jobs.media.previews import LatentPreview, LatentProjection
from omni_jobs.pipelines.spec import GpuShapedArgs, dit_engine_args

if TYPE_CHECKING:
    import PIL.Image
    import torch

LATENT_FACTOR = 8
"""Previews and latents are at 1/8 of the image's side, with 4 channels, as a PixArt/SD VAE's."""
_PROJECTION = LatentProjection(weight=np.vstack([np.eye(3, dtype=np.float32), np.zeros((1, 3), np.float32)]),
                               bias=np.zeros(3, np.float32))
"""Latent channels 0-2 are RGB in [0, 1]; channel 3 is noise."""


class GpuShapedDiT:
    """The GPU-shaped engine (see the module): ``generate`` as DiTEngine's, for text-to-image requests."""

    pipeline_class = "GpuShapedDiT"

    def __init__(self, *, ms_per_image: float = 20.0, gil_share: float = 0.06, batch_size: int = 32,
                 fixed_share: float = 0.17) -> None:
        args = self.args({"ms_per_image": ms_per_image, "gil_share": gil_share, "batch_size": batch_size,
                          "fixed_share": fixed_share})
        self.ms_per_image = args.ms_per_image
        self.gil_share = args.gil_share
        self.batch_size = args.batch_size
        self.fixed_share = args.fixed_share
        self.model = f"gpu-shaped:{self.ms_per_image:g}ms"
        self._lock = threading.RLock()  # one device: one batch at a time
        self._scratch = np.linspace(0.0, 1.0, 64)

    @staticmethod
    def args(engine_args: Mapping[str, JsonValue]) -> GpuShapedArgs:
        """``engine_args`` validated (ValueError naming the field: ``engine_args.gil_share: ...``)."""
        args = dit_engine_args({**engine_args, "kind": "gpu-shaped"})
        assert isinstance(args, GpuShapedArgs)
        return args

    @classmethod
    def from_args(cls, engine_args: Mapping[str, JsonValue]) -> GpuShapedDiT:
        args = cls.args(engine_args)
        return cls(ms_per_image=args.ms_per_image, gil_share=args.gil_share, batch_size=args.batch_size,
                   fixed_share=args.fixed_share)

    def batch_s(self, n: int) -> float:
        """What a device call of ``n`` images (at most ``batch_size``) takes, alone."""
        full = self.ms_per_image * self.batch_size / 1000
        return full * (self.fixed_share + (1 - self.fixed_share) * min(n, self.batch_size) / self.batch_size)

    def check_task(self, task: str, *, conditioned_on_embeds: bool = False) -> None:
        """It makes images from a prompt or prompt embeddings, nothing else."""
        if task != "text-to-image":
            raise ValueError(f"the GPU-shaped engine runs text-to-image stages only, not {task}")

    @contextmanager
    def turn(self) -> Iterator[None]:
        """The engine to itself (the batcher's batch is final once it has it); no engine turn: see the module."""
        with self._lock:
            yield

    def generate(self, requests: Sequence[DiTRequest], on_step: StepCallback | None = None) -> list[DiTOutput]:
        """Every request, in device calls of compatible requests of at most ``batch_size``; results in order."""
        for r in requests:
            self._check_request(r)
        groups: dict[object, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(group_key(r), []).append(i)
        calls = [idx[k:k + self.batch_size] for idx in groups.values() for k in range(0, len(idx), self.batch_size)]
        total = sum(requests[c[0]].num_inference_steps for c in calls)
        outputs: dict[int, DiTOutput] = {}
        done = 0
        with self._lock:
            telemetry.batch("dit", len(requests))
            for call in calls:
                batch = [requests[i] for i in call]
                for i, out in zip(call, self._call(batch, done, total, on_step), strict=True):
                    outputs[i] = out
                done += batch[0].num_inference_steps
        return [outputs[i] for i in range(len(requests))]

    def _check_request(self, r: DiTRequest) -> None:
        if r.is_audio or r.is_video or r.image is not None:
            raise ValueError(f"request {r.request_id!r}: the GPU-shaped engine makes images from text only")
        if r.height is None or r.width is None:
            raise ValueError(f"request {r.request_id!r}: an image request needs height and width")

    def _call(self, batch: list[DiTRequest], done: int, total: int, on_step: StepCallback | None) -> list[DiTOutput]:
        """One device call: per step, its CPU side (lock held) then its device part (lock released)."""
        steps = batch[0].num_inference_steps
        took = self.batch_s(len(batch))
        cpu_step, device_step = took * self.gil_share / steps, took * (1 - self.gil_share) / steps
        started = time.thread_time()  # the images are made within the CPU side's share, as a decode would be
        pixels = [image_pixels(r.seed, r.prompt or "", r.height or 0, r.width or 0) for r in batch]
        images = [_image(rgb) for rgb in pixels]
        for step in range(1, steps + 1):
            self._hold_lock_until(started + step * cpu_step)
            time.sleep(device_step)
            if on_step is not None:
                on_step(done + step, total)
            for r, rgb in zip(batch, pixels, strict=True):
                if r.previews_at(step) and r.on_preview is not None:
                    r.on_preview(LatentPreview(latents(rgb, r.seed, step / steps), _PROJECTION, step,
                                               r.denoising_steps, r.width or 0, r.height or 0))
        return [DiTOutput(r.request_id, image=image,
                          latents=_tensor(latents(rgb, r.seed, 1.0)) if r.want_latents else None)
                for r, rgb, image in zip(batch, pixels, images, strict=True)]

    def _hold_lock_until(self, cpu_at: float) -> None:
        """Small numpy operations and Python until this thread's CPU time reaches ``cpu_at`` (they hold
        the interpreter's lock: numpy releases it only for large arrays)."""
        x = self._scratch
        while time.thread_time() < cpu_at:
            for _ in range(20):
                x = np.sin(x * 1.0001 + 0.5)
        self._scratch = x


NOISE_BITS = 5
"""Each pixel's low 5 bits of noise: a 256 px image's PNG is ~140 KB (of 192 raw) and takes ~14 ms to encode
here, about what the random-weight model's images of the H200 run took (~190 KB, ~10-12 ms); smooth bands
alone made 0.9 KB PNGs, and no work for the encoder."""


@lru_cache(maxsize=8)
def _canvas(height: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pixel grid's rows and columns (uint16) and a fixed noise tile twice the size (uint8 [2h, 2w, 3])."""
    y, x = np.mgrid[0:height, 0:width]
    noise = np.random.default_rng(0).integers(0, 1 << NOISE_BITS, (2 * height, 2 * width, 3), dtype=np.uint8)
    return y.astype(np.uint16), x.astype(np.uint16), noise


def image_pixels(seed: int, prompt: str, height: int, width: int) -> np.ndarray:
    """uint8 [height, width, 3]: diagonal colour bands whose slopes and phases come from the seed and the
    prompt, plus a window of the size's noise tile placed by them (~0.25 ms at 256 px: a few integer
    operations a pixel)."""
    d = hashlib.blake2b(f"{seed}\n{prompt}".encode(), digest_size=16).digest()
    fy, fx, phase = [1 + d[c] % 3 for c in range(3)], [1 + d[3 + c] % 3 for c in range(3)], list(d[6:9])
    top, left = int.from_bytes(d[9:12]) % (height + 1), int.from_bytes(d[12:15]) % (width + 1)
    y, x, noise = _canvas(height, width)
    out = np.empty((height, width, 3), np.uint8)
    for c in range(3):
        out[..., c] = y * fy[c] + x * fx[c] + phase[c]  # uint16 (Python ints keep it so), wrapped to uint8
    out += noise[top:top + height, left:left + width]  # wraps around in uint8, as the bands do
    return out


def latents(rgb: np.ndarray, seed: int, progress: float) -> np.ndarray:
    """float32 [4, h/8, w/8]: the image at latent resolution, faded in from grey as denoising goes on,
    and a noise channel (what a preview projects: _PROJECTION)."""
    small = rgb[::LATENT_FACTOR, ::LATENT_FACTOR].astype(np.float32).transpose(2, 0, 1) / 255
    colour = 0.5 + progress * (small - 0.5)
    noise = np.random.default_rng(seed & 0xFFFFFFFF).standard_normal((1, *small.shape[1:])).astype(np.float32)
    return np.concatenate([colour, noise])


def _image(rgb: np.ndarray) -> PIL.Image.Image:
    from PIL import Image

    return Image.fromarray(rgb, "RGB")


def _tensor(values: np.ndarray) -> torch.Tensor:
    import torch

    return torch.from_numpy(values)
