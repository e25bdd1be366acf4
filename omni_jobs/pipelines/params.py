"""Per-stage parameters each engine accepts, with their bounds.

The same models validate a pipeline's stage defaults (when the YAML is loaded) and a job's
per-stage overrides (when it is submitted), so a bad value is caught before any GPU time is spent.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from omni_jobs.pipelines.modalities import EngineKind


class StageParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ARParams(StageParams):
    """Sampling parameters of an autoregressive (vLLM) stage."""

    max_tokens: int = Field(32, ge=1, le=4096, description="Tokens to generate.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Sampling seed (None: engine default).")
    prompt_template: str = Field(
        "{prompt}", max_length=4000, description="How the stage's prompt input is wrapped; must contain {prompt}."
    )

    @field_validator("prompt_template")
    @classmethod
    def _template_has_prompt(cls, value: str) -> str:
        if "{prompt}" not in value:
            raise ValueError("prompt_template must contain the placeholder {prompt}")
        try:
            value.format(prompt="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"prompt_template is not a valid format string: {exc}; escape braces as {{{{ }}}}") from exc
        return value


class DiTParams(StageParams):
    """Generation parameters of a diffusion (diffusers) stage."""

    height: int = Field(64, ge=16, le=2048, multiple_of=8, description="Image height in pixels (multiple of 8).")
    width: int = Field(64, ge=16, le=2048, multiple_of=8, description="Image width in pixels (multiple of 8).")
    num_inference_steps: int = Field(8, ge=1, le=200, description="Denoising steps.")
    guidance_scale: float = Field(4.5, ge=0.0, le=50.0, description="Classifier-free guidance scale.")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the initial noise; same seed, same image.")
    negative_prompt: str | None = Field(None, max_length=4000, description="What the image should not show.")


PARAMS_BY_ENGINE: dict[EngineKind, type[StageParams]] = {"ar": ARParams, "dit": DiTParams}


def params_model(engine: EngineKind) -> type[StageParams]:
    return PARAMS_BY_ENGINE[engine]


def merge_params(engine: EngineKind, defaults: dict[str, Any], overrides: dict[str, Any]) -> StageParams:
    """Stage defaults overlaid by a job's overrides, validated as one object."""
    return params_model(engine).model_validate({**defaults, **overrides})
