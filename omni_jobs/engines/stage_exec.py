"""From a stage of a pipeline to an engine call: which engine a stage needs, and how its inputs and
parameters become that engine's request and its outputs the stage's ports.

The table is (engine kind, task) -> executor; the AR generate executor lives in omni_jobs.stages.
Worker preloading and the stage runner both go through ``load_stage_engine``, so an engine that
cannot run its stage's task (an image pipeline on a text-to-audio stage, a DiT without a text
encoder fed text) is refused the same way at worker start and at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_jobs.engines.batching import BatchPolicy, dit_batcher
from omni_jobs.engines.dit import DiTEngine, DiTRequest, PreviewCallback
from omni_jobs.engines.encoder import EncodeRequest
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

ProgressFn = Callable[[int, int], None]


def load_stage_engine(engines: EnginePool, stage: StageSpec) -> Any:
    """The (cached) engine this stage runs on, checked against the stage's task."""
    if stage.engine == "ar":
        if stage.task_name == "encode":
            return engines.encoder(stage.model, stage.engine_args)
        return engines.ar(stage.model, stage.engine_args)
    engine = engines.dit(stage.model, stage.engine_args)
    engine.check_task(stage.task_name, conditioned_on_embeds=stage.conditioned_on_embeds)
    return engine


def execute_encode(engines: EnginePool, stage: StageSpec, params: StageParams, inputs: dict[str, Any],
                   request_id: str, progress: ProgressFn) -> dict[str, Any]:
    """AR encode: the prompt's per-token hidden states, [tokens, hidden], from vLLM's pooling runner."""
    assert isinstance(params, AREncodeParams)
    encoder = engines.encoder(stage.model, stage.engine_args)
    prompt = params.prompt_template.format(prompt=inputs["prompt"])
    (output,) = encoder.encode([EncodeRequest(request_id=request_id, prompt=prompt)])
    progress(len(output.token_ids), len(output.token_ids))
    return {"hidden_states": output.hidden_states}


def _embeds(value: Any) -> Any:
    """[tokens, dim] from a handed-over tensor ([1, tokens, dim] is accepted too)."""
    if value.ndim == 3 and value.shape[0] == 1:
        value = value[0]
    if value.ndim != 2:
        raise ValueError(f"prompt embeddings must be [tokens, dim], got shape {list(value.shape)}")
    return value


def execute_dit(engines: EnginePool, stage: StageSpec, params: StageParams, inputs: dict[str, Any],
                request_id: str, progress: ProgressFn, *, policy: BatchPolicy | None = None,
                preview: PreviewCallback | None = None) -> dict[str, Any]:
    """Any DiT task: text-to-image (text or prompt embeddings), image-to-image, text-to-audio,
    text-to-video.

    With a ``policy`` the request goes through the engine's batcher (stage workers: concurrent jobs
    share pipeline calls); without one it is a call of its own (the in-process Omni). ``preview``
    receives the latents every ``preview_every`` steps when the parameters ask for previews."""
    engine: DiTEngine = load_stage_engine(engines, stage)
    produced = stage.outputs
    conditioning: dict[str, Any] = (
        {"prompt_embeds": _embeds(inputs["prompt_embeds"])} if "prompt_embeds" in inputs else {"prompt": inputs["prompt"]}
    )
    common: dict[str, Any] = {
        "request_id": request_id,
        "seed": params.seed,  # type: ignore[attr-defined]
        "num_inference_steps": params.num_inference_steps,  # type: ignore[attr-defined]
        "guidance_scale": params.guidance_scale,  # type: ignore[attr-defined]
        "negative_prompt": params.negative_prompt,  # type: ignore[attr-defined]
        "want_latents": "latents" in produced,
        "preview_every": getattr(params, "preview_every", 0),
        "on_preview": preview,
        **conditioning,
    }
    if isinstance(params, DiTAudioParams):
        request = DiTRequest(duration_s=params.duration_s, **common)
    elif isinstance(params, DiTImageToImageParams):
        image = inputs["image"].convert("RGB")
        request = DiTRequest(height=params.height, width=params.width, image=image, strength=params.strength, **common)
    elif isinstance(params, DiTVideoParams):
        request = DiTRequest(height=params.height, width=params.width, num_frames=params.num_frames, **common)
    else:
        assert isinstance(params, DiTParams)
        request = DiTRequest(height=params.height, width=params.width, **common)
    if policy is not None:
        output = dit_batcher(engine, policy).submit(request, progress)
    else:
        (output,) = engine.generate([request], on_step=progress)
    values: dict[str, Any] = {}
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
