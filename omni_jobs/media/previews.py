"""Image previews of a running diffusion: a fixed linear latent -> RGB projection, encoded as JPEG.

Why a projection and not the VAE: decoding with the VAE, even at low resolution, costs about as
much as a denoising step or more (a full conv decoder per preview), and a preview every 5 steps
would then cost 10-20% of the stage; a projection is one [C] x [C, 3] product per latent pixel
(microseconds) and its look is what matters: colours and layout, at latent resolution, upscaled.

The projection is the least-squares fit of RGB on the latents, for the model's own VAE: at the
first preview of an engine, a few smooth synthetic colour fields are encoded by the VAE, decoded
back, and the decoded pixels (pooled to latent resolution) are regressed on the latents as the
pipeline sees them ([latent channels + 1] x 3 numbers). That is how the well-known 4-channel
Stable Diffusion factors were made, done for whichever VAE is loaded: 4-channel SD/PixArt VAEs,
16-channel Wan/SD3/Flux VAEs, 32-channel DC-AE (SANA), and the project's random-weight tiny models
alike, with no per-family table to keep. It runs once per engine, inside the engine's lock (some
VAEs keep per-call state), and takes milliseconds on the tiny models.

The engine's thread only copies the member's latents (one frame, for videos) to the CPU; the
projection, the resize and the JPEG encoding happen where the event is written (the progress
writer's thread), off the engine's critical path.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from omni_jobs.core.json_types import JsonObject, JsonValue

if TYPE_CHECKING:
    import PIL.Image
    import torch

MAX_SIDE = 256
"""A preview fits in MAX_SIDE x MAX_SIDE (the output's aspect ratio; never larger than the output)."""
JPEG_QUALITY = 80
MEDIA_TYPE = "image/jpeg"
FIT_IMAGES = 8
FIT_SEED = 1234


@dataclass(frozen=True)
class LatentProjection:
    """RGB in [0, 1] = latents (as the pipeline's denoising loop holds them) @ weight + bias."""

    weight: np.ndarray
    """[channels, 3]"""
    bias: np.ndarray
    """[3]"""

    @property
    def channels(self) -> int:
        return int(self.weight.shape[0])

    def to_rgb(self, latents: np.ndarray) -> np.ndarray:
        """uint8 [h, w, 3] from latents [channels, h, w]."""
        if latents.ndim != 3 or latents.shape[0] != self.channels:
            raise ValueError(f"latents must be [{self.channels}, h, w], got {list(latents.shape)}")
        rgb = np.einsum("chw,ck->hwk", latents.astype(np.float32), self.weight) + self.bias
        return np.asarray(np.round(np.clip(rgb, 0.0, 1.0) * 255), dtype=np.uint8)


def preview_size(width: int, height: int, max_side: int = MAX_SIDE) -> tuple[int, int]:
    """(width, height) of the preview of a ``width`` x ``height`` output."""
    scale = min(1.0, max_side / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


@dataclass(frozen=True)
class LatentPreview:
    """One member's latents at one step, ready to encode (cheap to make: a CPU copy of one frame)."""

    latents: np.ndarray
    """[channels, h, w] float32, one frame (the middle one of a video)."""
    projection: LatentProjection
    step: int
    total: int
    width: int
    """Of the output: the preview keeps its aspect ratio (see preview_size)."""
    height: int

    def image(self) -> PIL.Image.Image:
        """The preview as a PIL image of ``preview_size(width, height)``."""
        from PIL import Image

        small = Image.fromarray(self.projection.to_rgb(self.latents), mode="RGB")
        return small.resize(preview_size(self.width, self.height), Image.Resampling.BILINEAR)

    def encode(self) -> bytes:
        buf = io.BytesIO()
        self.image().save(buf, format="JPEG", quality=JPEG_QUALITY)
        return buf.getvalue()

    def event_data(self, stage: str) -> JsonObject:
        """The ``output.preview`` event's data: ``{stage, step, total, media_type, width, height, data}``."""
        width, height = preview_size(self.width, self.height)
        return {"stage": stage, "step": self.step, "total": self.total, "media_type": MEDIA_TYPE,
                "width": width, "height": height, "data": base64.b64encode(self.encode()).decode("ascii")}


def decode_preview(data: Mapping[str, JsonValue]) -> PIL.Image.Image:
    """The PIL image of an ``output.preview`` event's data (clients, Omni's ``stream``)."""
    from PIL import Image

    encoded = data.get("data")
    if not isinstance(encoded, str):
        raise TypeError("an output.preview event's data has no base64 'data'")
    image = Image.open(io.BytesIO(base64.b64decode(encoded)))
    image.load()
    return image


def spatial_latents(pipe: object, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[batch, channels, h, w] (images) or [batch, channels, frames, h, w] (videos) from what a
    pipeline's step callback holds: packed sequences (Flux, Chroma) are unpacked."""
    if latents.ndim == 3:
        unpack = getattr(pipe, "_unpack_latents", None)
        factor = getattr(pipe, "vae_scale_factor", None)
        if unpack is None or factor is None:
            raise ValueError(f"{type(pipe).__name__}: cannot unpack latents shaped {list(latents.shape)}")
        unpacked: torch.Tensor = unpack(latents, height, width, factor)
        return unpacked
    return latents


def one_frame(latents: torch.Tensor) -> np.ndarray:
    """[channels, h, w] float32 on the CPU from one member's [channels, (frames,) h, w]: the middle
    frame of a video (the first is an image in Wan's causal VAE; the middle shows motion)."""
    if latents.ndim == 4:
        latents = latents[:, latents.shape[1] // 2]
    return latents.detach().to("cpu", dtype=_float32()).numpy().copy()


def _float32() -> torch.dtype:
    import torch

    return torch.float32


def fit_projection(pipe: object) -> LatentProjection | None:
    """The least-squares latent -> RGB map of ``pipe``'s VAE (see the module doc); None without one."""
    import torch

    vae = getattr(pipe, "vae", None)
    config = getattr(vae, "config", None)
    if vae is None or config is None or not hasattr(vae, "encode"):
        return None
    video = hasattr(config, "latents_mean") and hasattr(config, "z_dim")  # Wan-style 3D VAE
    factor = int(getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None) or 8)
    size = max(64, 8 * factor)
    param = next(vae.parameters())
    generator = torch.Generator("cpu").manual_seed(FIT_SEED)
    coarse = torch.rand(FIT_IMAGES, 3, 4, 4, generator=generator)
    images = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    images = (images.clamp(0, 1) * 2 - 1).to(param.device, param.dtype)
    with torch.no_grad():
        if video:
            z = vae.encode(images[:, :, None]).latent_dist.mean
            decoded = vae.decode(z).sample[:, :, 0]
            mean = torch.tensor(config.latents_mean, dtype=z.dtype, device=z.device).view(1, -1, 1, 1, 1)
            std = torch.tensor(config.latents_std, dtype=z.dtype, device=z.device).view(1, -1, 1, 1, 1)
            latents = ((z - mean) / std)[:, :, 0]
        else:
            z = vae.encode(images).latent_dist.mean
            decoded = vae.decode(z).sample
            shift = getattr(config, "shift_factor", None) or 0.0
            latents = (z - shift) * (getattr(config, "scaling_factor", None) or 1.0)
    h, w = latents.shape[-2:]
    target = torch.nn.functional.adaptive_avg_pool2d((decoded.float() + 1) / 2, (h, w))
    x = latents.float().permute(0, 2, 3, 1).reshape(-1, latents.shape[1]).cpu()
    y = target.permute(0, 2, 3, 1).reshape(-1, 3).cpu()
    x1 = torch.cat([x, torch.ones(len(x), 1)], dim=1)
    solution = torch.linalg.lstsq(x1.double(), y.double()).solution.float().numpy()
    return LatentProjection(weight=solution[:-1].copy(), bias=solution[-1].copy())
