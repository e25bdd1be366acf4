"""From a stage of a pipeline to an engine call: which engine a stage needs, and how its inputs and
parameters become that engine's request and its outputs the stage's ports.

The table is (engine kind, task) -> executor; the AR generate executor lives in omni_jobs.stages.
Worker preloading and the stage runner both go through ``load_stage_engine``, so an engine that
cannot run its stage's task (an image pipeline on a text-to-audio stage, a DiT without a text
encoder fed text) is refused the same way at worker start and at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from omni_jobs.engines.ar import AREngine
from omni_jobs.engines.batching import BatchPolicy, dit_batcher
from omni_jobs.engines.dit import DiTEngine, DiTRequest, PreviewCallback
from omni_jobs.engines.encoder import AREncoder, EncodeRequest
from omni_jobs.engines.pool import EnginePool
from omni_jobs.payloads import AudioClip, VideoClip
from omni_jobs.pipelines.params import (
    AREncodeParams,
    DiTAudioParams,
    DiTImageToImageParams,
    DiTParams,
    DiTVideoParams,
    StageParams,
)
from omni_jobs.pipelines.spec import StageSpec

if TYPE_CHECKING:
    import PIL.Image
    import torch

ProgressFn = Callable[[int, int], None]
StageValues = dict[str, object]
"""A stage's values by port: what its engine is handed (text, a tensor, a PIL image...) or made
(an AudioClip, a VideoClip...); omni_jobs.payloads encodes and decodes them."""


def load_stage_engine(engines: EnginePool, stage: StageSpec) -> AREngine | AREncoder | DiTEngine:
    """The (cached) engine this stage runs on, checked against the stage's task."""
    if stage.engine == "ar":
        if stage.task_name == "encode":
            return engines.encoder(stage.model, stage.engine_args)
        return engines.ar(stage.model, stage.engine_args)
    return _dit_engine(engines, stage)


def _dit_engine(engines: EnginePool, stage: StageSpec) -> DiTEngine:
    engine = engines.dit(stage.model, stage.engine_args)
    engine.check_task(stage.task_name, conditioned_on_embeds=stage.conditioned_on_embeds)
    return engine


def execute_encode(engines: EnginePool, stage: StageSpec, params: StageParams, inputs: Mapping[str, object],
                   request_id: str, progress: ProgressFn) -> StageValues:
    """AR encode: the prompt's per-token hidden states, [tokens, hidden], from vLLM's pooling runner."""
    assert isinstance(params, AREncodeParams)
    encoder = engines.encoder(stage.model, stage.engine_args)
    prompt = params.prompt_template.format(prompt=inputs["prompt"])
    (output,) = encoder.encode([EncodeRequest(request_id=request_id, prompt=prompt)])
    progress(len(output.token_ids), len(output.token_ids))
    return {"hidden_states": output.hidden_states}


def _prompt(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a prompt is text, got {type(value).__name__}")
    return value


def _image(value: object) -> PIL.Image.Image:
    from PIL import Image

    if not isinstance(value, Image.Image):
        raise TypeError(f"an image input is a PIL image, got {type(value).__name__}")
    return value


def _embeds(value: object) -> torch.Tensor:
    """[tokens, dim] from a handed-over tensor ([1, tokens, dim] is accepted too)."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"prompt embeddings must be a tensor, got {type(value).__name__}")
    if value.ndim == 3 and value.shape[0] == 1:
        value = value[0]
    if value.ndim != 2:
        raise ValueError(f"prompt embeddings must be [tokens, dim], got shape {list(value.shape)}")
    return value


def execute_dit(engines: EnginePool, stage: StageSpec, params: StageParams, inputs: Mapping[str, object],
                request_id: str, progress: ProgressFn, *, policy: BatchPolicy | None = None,
                preview: PreviewCallback | None = None) -> StageValues:
    """Any DiT task: text-to-image (text or prompt embeddings), image-to-image, text-to-audio,
    text-to-video.

    With a ``policy`` the request goes through the engine's batcher (stage workers: concurrent jobs
    share pipeline calls); without one it is a call of its own (the in-process Omni). ``preview``
    receives the latents every ``preview_every`` steps when the parameters ask for previews."""
    if not isinstance(params, DiTParams | DiTAudioParams | DiTVideoParams):
        raise TypeError(f"a DiT stage's parameters are DiT parameters, got {type(params).__name__}")
    engine = _dit_engine(engines, stage)
    produced = stage.outputs
    prompt_embeds = _embeds(inputs["prompt_embeds"]) if "prompt_embeds" in inputs else None
    height = width = num_frames = None
    duration_s = strength = None
    image = None
    if isinstance(params, DiTAudioParams):
        duration_s = params.duration_s
    elif isinstance(params, DiTImageToImageParams):
        height, width, strength = params.height, params.width, params.strength
        image = _image(inputs["image"]).convert("RGB")
    elif isinstance(params, DiTVideoParams):
        height, width, num_frames = params.height, params.width, params.num_frames
    else:
        height, width = params.height, params.width
    request = DiTRequest(
        request_id=request_id, prompt=_prompt(inputs["prompt"]) if prompt_embeds is None else None,
        prompt_embeds=prompt_embeds, seed=params.seed, num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale, negative_prompt=params.negative_prompt,
        want_latents="latents" in produced, on_preview=preview,
        preview_every=0 if isinstance(params, DiTAudioParams) else params.preview_every,
        height=height, width=width, num_frames=num_frames, duration_s=duration_s, image=image, strength=strength,
    )
    if policy is not None:
        output = dit_batcher(engine, policy).submit(request, progress)
    else:
        (output,) = engine.generate([request], on_step=progress)
    values: StageValues = {}
    if "image" in produced:
        values["image"] = output.image
    if "audio" in produced:
        if output.audio is None or output.sample_rate is None:
            raise RuntimeError(f"{engine.pipeline_class} returned no audio")
        values["audio"] = AudioClip(output.audio, output.sample_rate)
    if "video" in produced:
        if output.video is None or not isinstance(params, DiTVideoParams):
            raise RuntimeError(f"{engine.pipeline_class} returned no video")
        values["video"] = VideoClip(output.video, params.fps)
    if "latents" in produced:
        values["latents"] = output.latents
    return values
