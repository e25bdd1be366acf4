"""Input limits of a deployment (settings), checked when a job is submitted.

The pipeline specs and parameter models already bound every field (e.g. a prompt's max_length,
width <= 2048); these caps apply on top of them to every pipeline, so an operator can lower what
one request may cost without editing each pipeline. Each breach is a FieldError naming the field,
the limit and the setting that raises it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from omni_jobs.core.errors import FieldError
from omni_jobs.core.settings import Settings
from omni_jobs.pipelines.spec import PipelineSpec

PARAM_CAPS: dict[str, tuple[str, str]] = {
    "max_tokens": ("max_tokens", "OMNI_MAX_TOKENS"),
    "num_inference_steps": ("max_steps", "OMNI_MAX_STEPS"),
    "width": ("max_image_side", "OMNI_MAX_IMAGE_SIDE"),
    "height": ("max_image_side", "OMNI_MAX_IMAGE_SIDE"),
}
"""Stage parameter -> (Limits attribute that caps it, the setting to raise it)."""


@dataclass(frozen=True)
class Limits:
    max_prompt_chars: int = 20000
    max_image_bytes: int = 16 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_audio_bytes: int = 25 * 1024 * 1024
    max_audio_seconds: float = 600
    max_video_bytes: int = 64 * 1024 * 1024
    max_video_seconds: float = 120
    max_video_frames: int = 1800
    max_video_pixels: int = 1920 * 1080
    max_steps: int = 200
    max_image_side: int = 2048
    max_tokens: int = 4096
    max_outputs: int = 10

    @classmethod
    def from_settings(cls, s: Settings) -> Limits:
        return cls(max_prompt_chars=s.max_prompt_chars, max_image_bytes=s.max_image_bytes,
                   max_image_pixels=s.max_image_pixels, max_audio_bytes=s.max_audio_bytes,
                   max_audio_seconds=s.max_audio_seconds, max_video_bytes=s.max_video_bytes,
                   max_video_seconds=s.max_video_seconds, max_video_frames=s.max_video_frames,
                   max_video_pixels=s.max_video_pixels, max_steps=s.max_steps, max_image_side=s.max_image_side,
                   max_tokens=s.max_tokens, max_outputs=s.max_outputs)

    def check_input(self, spec: PipelineSpec, input_: Mapping[str, object]) -> list[FieldError]:
        """Text inputs longer than max_prompt_chars."""
        errors: list[FieldError] = []
        for name, value in input_.items():
            field = spec.inputs.get(name)
            if field is not None and field.type == "text" and isinstance(value, str) \
                    and len(value) > self.max_prompt_chars:
                errors.append(FieldError(("input", name), f"is {len(value)} characters; this server takes at most "
                                         f"{self.max_prompt_chars} (OMNI_MAX_PROMPT_CHARS)", "too_long"))
        return errors

    def check_params(self, params: Mapping[str, Mapping[str, object]]) -> list[FieldError]:
        """Resolved stage parameters above this server's caps (steps, width/height, max_tokens)."""
        errors: list[FieldError] = []
        for stage_id, values in params.items():
            for name, (attr, setting) in PARAM_CAPS.items():
                value = values.get(name)
                cap: int = getattr(self, attr)
                if isinstance(value, int | float) and not isinstance(value, bool) and value > cap:
                    errors.append(FieldError(("params", stage_id, name), f"is {value}; this server allows at most "
                                             f"{cap} ({setting})", "less_than_equal"))
        return errors
