"""Per-stage parameters each engine task accepts, with their bounds.

The same models validate a pipeline's stage defaults (when the YAML is loaded) and a job's
per-stage overrides (when it is submitted), so a bad value is caught before any GPU time is spent;
the merged, validated values are recorded on the job.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from omni_jobs.core.json_types import JsonObject
from omni_jobs.pipelines.modalities import DEFAULT_TASK, EngineKind

SEED_MAX = 2**63 - 1
SEED = Field(0, ge=0, le=SEED_MAX, description="Seed of the initial noise; same seed, same output.")
PREVIEW_EVERY = Field(
    0, ge=0, le=1000, description="Publish an output.preview event (a JPEG of the latents) every that many "
    "denoising steps, not at the last; 0: no previews."
)


def whole_number(value: object) -> object:
    """JSON Schema's integer is a number without a fraction: 7.0 is one (it is taken as 7)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def whole_numbers(model: type[BaseModel], value: object, field: str | None) -> object:
    """``value`` for ``model``'s ``field``: an integer field takes 7.0 as 7 (a strict model would refuse it)."""
    annotation = model.model_fields[field].annotation if field in model.model_fields else None
    return whole_number(value) if annotation is int or int in get_args(annotation) else value


BOUND_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of"})
"""Pydantic's error types for a number out of its bounds: each names one bound, the first one missed."""


def number_in_words(value: float) -> str:
    """A number as a person reads it: 7 rather than 7.0, 2^63-1 rather than 19 digits."""
    if value == SEED_MAX:
        return "2^63-1"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def bounds_in_words(minimum: float | None = None, maximum: float | None = None,
                    exclusive_minimum: float | None = None, exclusive_maximum: float | None = None,
                    multiple_of: float | None = None) -> list[str]:
    """A number's bounds (its JSON schema's) as words: ['16 to 2048', 'a multiple of 8'], ['more than 0',
    'at most 1']. Said in full, so that a value refused for one bound is not then refused for the next."""
    low = (f"at least {number_in_words(minimum)}" if minimum is not None
           else f"more than {number_in_words(exclusive_minimum)}" if exclusive_minimum is not None else None)
    high = (f"at most {number_in_words(maximum)}" if maximum is not None
            else f"less than {number_in_words(exclusive_maximum)}" if exclusive_maximum is not None else None)
    parts = ([f"{number_in_words(minimum)} to {number_in_words(maximum)}"] if minimum is not None and maximum is not None
             else [p for p in (low, high) if p])
    if multiple_of is not None:
        parts.append(f"a multiple of {number_in_words(multiple_of)}")
    return parts


class StageParams(BaseModel):
    """Strict: a value is taken as its JSON schema types it (no "7" or true for an integer, no "0.5"
    for a number), so that the OpenAPI spec, built from these models, says what is accepted."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _whole_numbers(cls, value: object, info: ValidationInfo) -> object:
        return whole_numbers(cls, value, info.field_name)


_LITERAL = r"(?:[^{}]|\{\{|\}\})"
TEMPLATE_PATTERN = rf"^{_LITERAL}*\{{prompt\}}(?:{_LITERAL}|\{{prompt\}})*$"
"""A prompt template: text with at least one ``{prompt}`` placeholder; other braces doubled ({{ }})."""
_TEMPLATE = re.compile(TEMPLATE_PATTERN.removeprefix("^").removesuffix("$"))
_WELL_FORMED = re.compile(rf"(?:{_LITERAL}|\{{prompt\}})*")


def _check_template(value: str) -> str:
    """What TEMPLATE_PATTERN says (the spec carries the pattern), with a message for each way to miss it."""
    if _WELL_FORMED.fullmatch(value) is None:
        raise ValueError("prompt_template is not a valid template: its one placeholder is {prompt}; "
                         "escape other braces as {{ }}")
    if _TEMPLATE.fullmatch(value) is None:
        raise ValueError("prompt_template must contain the placeholder {prompt}")
    return value


class ARParams(StageParams):
    """Sampling parameters of an autoregressive (vLLM) generate stage."""

    max_tokens: int = Field(32, ge=1, le=4096, description="Tokens to generate.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="Sampling seed (None: engine default).")
    prompt_template: str = Field(
        "{prompt}", max_length=4000, json_schema_extra={"pattern": TEMPLATE_PATTERN},
        description="How the stage's prompt input is wrapped; must contain {prompt}.",
    )

    chat: bool = Field(
        False, description="Wrap the prompt in the model's chat template as a user turn (multimodal models: with "
        "each image's, clip's and video's placeholder before it).",
    )
    system_prompt: str | None = Field(None, max_length=4000, description="With chat: a system turn before it.")

    @field_validator("prompt_template")
    @classmethod
    def _template_has_prompt(cls, value: str) -> str:
        return _check_template(value)


class ARTranscribeParams(StageParams):
    """Parameters of a speech-to-text stage (Whisper and the like on vLLM)."""

    task: Literal["transcribe", "translate"] = Field(
        "transcribe", description="transcribe: text in the spoken language; translate: English text.")
    language: str | None = Field(
        None, pattern=r"^[a-z]{2,3}$", description="The spoken language (ISO 639-1, e.g. 'en'); None: detected.")
    max_tokens: int = Field(224, ge=1, le=4096, description="Tokens at most per 30 s chunk of audio.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="Sampling seed (None: engine default).")


class AREncodeParams(StageParams):
    """Parameters of an AR encode stage (vLLM pooling runner: per-token hidden states, no sampling)."""

    prompt_template: str = Field(
        "{prompt}", max_length=4000, json_schema_extra={"pattern": TEMPLATE_PATTERN},
        description="How the stage's prompt input is wrapped; must contain {prompt}.",
    )

    @field_validator("prompt_template")
    @classmethod
    def _template_has_prompt(cls, value: str) -> str:
        return _check_template(value)


class ARReciteParams(StageParams):
    """Parameters of a thinker that recites its prompt (text to speech): the turn its talker hears it in."""

    system_prompt: str | None = Field(None, max_length=4000, description="A system turn before the user turn whose "
                                      "reply the text is.")
    instructions: str = Field("Say this.", min_length=1, max_length=4000, description="The user turn the text "
                              "answers (how to say it, say).")


SPEAKER_DESCRIPTION = "The voice: one of the checkpoint's speakers (Qwen2.5-Omni: Chelsie, Ethan)."


class ARTalkParams(StageParams):
    """Sampling parameters of a talker stage (Qwen2.5-Omni's: its generate defaults)."""

    speaker: Literal["Chelsie", "Ethan"] = Field("Chelsie", description=SPEAKER_DESCRIPTION)
    max_tokens: int = Field(1024, ge=1, le=8192, description="Codes at most (50 a second of speech).")
    temperature: float = Field(0.9, ge=0.0, le=2.0, description="0 is greedy decoding.")
    top_p: float = Field(0.8, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(40, ge=0, le=8448, description="Sample among the k likeliest codes; 0: all.")
    repetition_penalty: float = Field(1.05, ge=1.0, le=2.0, description="Above 1, codes already written are less "
                                      "likely (transformers' rule).")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="Sampling seed (None: engine default).")


class DiTCode2WavParams(StageParams):
    """Parameters of a code-to-waveform stage (Qwen2.5-Omni's token2wav)."""

    speaker: Literal["Chelsie", "Ethan"] = Field("Chelsie", description=SPEAKER_DESCRIPTION)
    num_inference_steps: int = Field(10, ge=2, le=100, description="Flow-matching ODE steps (Qwen2.5-Omni: 10).")
    guidance_scale: float = Field(0.5, ge=0.0, le=10.0, description="Classifier-free guidance scale (Qwen2.5-Omni: "
                                  "0.5).")
    seed: int = SEED


class DiTParams(StageParams):
    """Generation parameters of a diffusion (diffusers) text-to-image stage."""

    height: int = Field(64, ge=16, le=2048, multiple_of=8, description="Image height in pixels (multiple of 8).")
    width: int = Field(64, ge=16, le=2048, multiple_of=8, description="Image width in pixels (multiple of 8).")
    num_inference_steps: int = Field(8, ge=1, le=200, description="Denoising steps.")
    guidance_scale: float = Field(4.5, ge=0.0, le=50.0, description="Classifier-free guidance scale.")
    seed: int = SEED
    negative_prompt: str | None = Field(None, max_length=4000, description="What the image should not show.")
    preview_every: int = PREVIEW_EVERY


def _no_negative_prompt_schema(schema: JsonObject) -> None:
    properties = schema["properties"]
    assert isinstance(properties, dict), "pydantic's schema of a model has its properties"
    properties["negative_prompt"] = {
        "type": "null", "default": None, "title": "Negative Prompt",
        "description": "Not taken: this stage has no text encoder of its own (it is conditioned on prompt_embeds)."}


class DiTEmbedsParams(DiTParams):
    """A text-to-image stage conditioned on upstream prompt embeddings: it has no text to negate."""

    model_config = ConfigDict(json_schema_extra=_no_negative_prompt_schema)

    @model_validator(mode="after")
    def _no_negative_prompt(self) -> DiTEmbedsParams:
        if self.negative_prompt is not None:
            raise ValueError(
                "negative_prompt needs the DiT's own text encoder, but this stage is conditioned on "
                "prompt_embeds from an upstream stage; leave it unset (guidance uses zero embeddings)"
            )
        return self


class DiTImageToImageParams(DiTParams):
    """An image-to-image stage: the input image is resized to height x width, then partly re-noised."""

    height: int | None = Field(  # type: ignore[assignment]  # narrows the base's int to int | None: None means the input's size
        None, ge=16, le=2048, multiple_of=8, description="Output height (multiple of 8); None: the input's, rounded."
    )
    width: int | None = Field(  # type: ignore[assignment]  # narrows the base's int to int | None: None means the input's size
        None, ge=16, le=2048, multiple_of=8, description="Output width (multiple of 8); None: the input's, rounded."
    )
    strength: float = Field(
        0.6, gt=0.0, le=1.0, description="How much to change the image: 1 ignores it, small values keep it. "
        "strength x num_inference_steps must be at least 1 (a denoising step)."
    )

    @model_validator(mode="after")
    def _at_least_one_step(self) -> DiTImageToImageParams:
        if self.num_inference_steps * self.strength < 1:
            raise ValueError(
                f"strength {self.strength} x num_inference_steps {self.num_inference_steps} leaves no denoising "
                "step; raise either so that their product is at least 1"
            )
        return self


class DiTAudioParams(StageParams):
    """Generation parameters of a diffusion text-to-audio stage (StableAudio family)."""

    duration_s: float = Field(
        1.0, gt=0.0, le=600.0, description="Length of the clip in seconds (at most what the model can make)."
    )
    num_inference_steps: int = Field(8, ge=1, le=200, description="Denoising steps.")
    guidance_scale: float = Field(7.0, ge=0.0, le=50.0, description="Classifier-free guidance scale.")
    seed: int = SEED
    negative_prompt: str | None = Field(None, max_length=4000, description="What the audio should not contain.")


class DiTVideoParams(StageParams):
    """Generation parameters of a diffusion text-to-video stage (Wan family)."""

    height: int = Field(32, ge=16, le=2048, multiple_of=16, description="Frame height in pixels (multiple of 16).")
    width: int = Field(32, ge=16, le=2048, multiple_of=16, description="Frame width in pixels (multiple of 16).")
    num_frames: int = Field(
        9, ge=1, le=1025, description="Frames to make; 4k+1 for Wan (its VAE compresses time 4x), e.g. 9, 17, 81."
    )
    fps: float = Field(16.0, gt=0.0, le=120.0, description="Frame rate of the MP4 (Wan 2.1 is trained at 16).")
    num_inference_steps: int = Field(8, ge=1, le=200, description="Denoising steps.")
    guidance_scale: float = Field(5.0, ge=0.0, le=50.0, description="Classifier-free guidance scale.")
    seed: int = SEED
    negative_prompt: str | None = Field(None, max_length=4000, description="What the video should not show.")
    preview_every: int = PREVIEW_EVERY


PARAMS_BY_TASK: dict[tuple[EngineKind, str], type[StageParams]] = {
    ("ar", "generate"): ARParams,
    ("ar", "encode"): AREncodeParams,
    ("ar", "transcribe"): ARTranscribeParams,
    ("ar", "talk"): ARTalkParams,
    ("ar", "recite"): ARReciteParams,
    ("dit", "text-to-image"): DiTParams,
    ("dit", "image-to-image"): DiTImageToImageParams,
    ("dit", "text-to-audio"): DiTAudioParams,
    ("dit", "text-to-video"): DiTVideoParams,
    ("dit", "code2wav"): DiTCode2WavParams,
}


def params_model(engine: EngineKind, task: str | None = None, *, conditioned_on_embeds: bool = False) -> type[StageParams]:
    """The parameter model of ``task`` on ``engine`` (its default task when None)."""
    model = PARAMS_BY_TASK[(engine, task or DEFAULT_TASK[engine])]
    if model is DiTParams and conditioned_on_embeds:
        return DiTEmbedsParams
    return model

