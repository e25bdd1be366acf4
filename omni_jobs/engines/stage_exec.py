"""From a stage of a pipeline to an engine call: which engine a stage needs, and how its inputs and
parameters become that engine's request and its outputs the stage's ports.

The table is (engine kind, task) -> executor; the AR generate executor lives in omni_jobs.run.stage_calls (it
streams text), and builds its request here (``ar_request``).
Worker preloading and the stage runner both go through ``load_stage_engine``, so an engine that
cannot run its stage's task (an image pipeline on a text-to-audio stage, a DiT without a text
encoder fed text) is refused the same way at worker start and at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from omni_jobs.core.json_types import JsonObject, JsonValue
from omni_jobs.engines import omni_speech
from omni_jobs.engines.ar import AREngine, AROutput, ARRequest, SamplingOptions, TextSoFar
from omni_jobs.engines.batching import Batcher, BatchPolicy, ar_batcher, dit_batcher
from omni_jobs.engines.code2wav import Code2WavRequest, code2wav_batcher
from omni_jobs.engines.dit import DiTOutput, DiTRequest, PreviewCallback
from omni_jobs.engines.encoder import AREncoder, EncodeRequest
from omni_jobs.engines.engine_client import DiTEngineProcess, ProcessBatcher
from omni_jobs.engines.pool import Code2WavKind, DiTKind, EnginePool
from omni_jobs.engines.talker import Talker, TalkSampling, thinker_states
from omni_jobs.media.payloads import AudioClip, VideoClip
from omni_jobs.pipelines.modalities import MEDIA_PORTS, THINKER_OUTPUTS
from omni_jobs.pipelines.params import (
    AREncodeParams,
    ARParams,
    ARReciteParams,
    ARTalkParams,
    ARTranscribeParams,
    DiTAudioParams,
    DiTCode2WavParams,
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
CodesSoFar = Callable[[list[int]], None]
"""A talker's codes so far (its stop code left out), at each engine step: what streamed speech is made from."""
StageValues = dict[str, object]
"""A stage's values by port: what its engine is handed (text, a tensor, a PIL image...) or made
(an AudioClip, a VideoClip...); omni_jobs.media.payloads encodes and decodes them."""


def load_stage_engine(engines: EnginePool, stage: StageSpec) -> AREngine | AREncoder | DiTKind | Code2WavKind:
    """The (cached) engine this stage runs on, checked against the stage's task (a thinker stage that hands its
    talker states loads the model's pooling engine too)."""
    if stage.engine == "ar":
        if stage.task_name == "encode":
            return engines.encoder(stage.model, stage.engine_args)
        engine = engines.ar(stage.model, ar_engine_args(stage))
        if stage.task_name == "transcribe":
            engine.transcriber  # noqa: B018 - a model that is no speech-to-text model is refused here, at load
        if stage.task_name == "talk":
            Talker(engine)  # a model that is no whole Qwen2.5-Omni checkpoint is refused here, at load
        if stage.task_name in ("generate", "recite") and set(stage.outputs) & set(THINKER_OUTPUTS):
            engines.encoder(stage.model, thinker_encoder_args(stage))
        return engine
    if stage.task_name == "code2wav":
        return engines.code2wav(stage.model, stage.engine_args)
    return _dit_engine(engines, stage)


def ar_engine_args(stage: StageSpec) -> dict[str, JsonValue]:
    """A generating stage's vLLM arguments: its own, plus what its wiring needs (prompt embeddings on; room
    for as many images, clips and videos a prompt as the stage is wired to; a talker's model class), unless it
    set them itself."""
    args: dict[str, JsonValue] = dict(stage.engine_args)
    if stage.task_name == "talk":
        args.setdefault("hf_overrides", {"architectures": [omni_speech.TALKER_ARCH]})
    if "prompt_embeds" in stage.inputs:
        args.setdefault("enable_prompt_embeds", True)
    many = {port: len(bound) for port, bound in stage.inputs.items() if isinstance(bound, tuple) and len(bound) > 1}
    if many and "limit_mm_per_prompt" not in args:
        args["limit_mm_per_prompt"] = dict(many)
    return args


def ar_request(engines: EnginePool, stage: StageSpec, params: ARParams, inputs: Mapping[str, object],
               request_id: str, *, on_text: TextSoFar | None = None) -> ARRequest:
    """The engine request of an AR generate stage: its prompt (text, or upstream embeddings through the
    stage's projection), its media by modality, its sampling and chat settings."""
    sampling = SamplingOptions(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                               seed=params.seed)
    embeds = None
    prompt = ""
    if "prompt_embeds" in inputs:
        embeds = _embeds(inputs["prompt_embeds"])
        if stage.projection is not None:
            embeds = engines.projection(stage.projection.model, stage.projection.weight)(embeds)
    else:
        prompt = params.prompt_template.format(prompt=_prompt(inputs["prompt"]))
    media = {port: _listed(inputs[port]) for port in MEDIA_PORTS if port in inputs}
    return ARRequest(request_id=request_id, prompt=prompt, sampling=sampling, on_text=on_text, media=media,
                     chat=params.chat, system_prompt=params.system_prompt, prompt_embeds=embeds)


def _listed(value: object) -> list[object]:
    return list(value) if isinstance(value, list | tuple) else [value]


def execute_transcribe(engines: EnginePool, stage: StageSpec, params: StageParams, inputs: Mapping[str, object],
                       request_id: str, progress: ProgressFn, *, policy: BatchPolicy | None = None) -> StageValues:
    """Speech to text: the clip in the model's chunks, each one request (batched with other jobs'), the
    language detected first where the model needs one and none was given; the text, with its segments."""
    assert isinstance(params, ARTranscribeParams)
    engine = engines.ar(stage.model, ar_engine_args(stage))
    transcriber = engine.transcriber
    clip = inputs["audio"]
    if not isinstance(clip, AudioClip):
        raise TypeError(f"a transcription's audio is an AudioClip, got {type(clip).__name__}")
    chunks, spans, duration = transcriber.chunks(clip, params.task)
    language = transcriber.validate_language(params.language)

    def run(requests: list[ARRequest]) -> list[AROutput]:
        if policy is not None:
            batcher = ar_batcher(engine, policy)
            return [batcher.submit(r) for r in requests]
        return engine.generate(requests)

    if language is None and transcriber.detects_language:
        prompt, allowed = transcriber.detection(chunks[0], params.task)
        (detected,) = run([ARRequest(request_id=f"{request_id}:language", prompt="", engine_prompt=prompt,
                                     sampling=SamplingOptions(max_tokens=1, allowed_token_ids=tuple(allowed)))])
        language = transcriber.parse_language(detected.token_ids)
    prompt_text = _prompt(inputs["prompt"]) if "prompt" in inputs else ""
    prompts = transcriber.prompts(chunks, task=params.task, language=language, prompt=prompt_text)
    sampling = SamplingOptions(max_tokens=params.max_tokens, temperature=params.temperature, seed=params.seed)
    segments: list[JsonValue] = []
    texts: list[str] = []
    prompt_tokens = completion_tokens = 0
    for i, (chunk_prompt, (start, end)) in enumerate(zip(prompts, spans, strict=True)):
        (out,) = run([ARRequest(request_id=f"{request_id}:{i}", prompt="", engine_prompt=chunk_prompt,
                                sampling=sampling)])
        text = transcriber.clean(out.text).strip()
        texts.append(text)
        segments.append({"id": i, "start": round(start, 3), "end": round(end, 3), "text": text})
        prompt_tokens += len(out.prompt_token_ids)
        completion_tokens += len(out.token_ids)
        progress(i + 1, len(chunks))
    document: JsonObject = {
        "text": transcriber.join(texts, language), "language": language, "duration": round(duration, 3), "task": params.task,
        "segments": segments, "finish_reason": "stop",
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "seconds": round(duration, 3)},
    }
    return {"text": document}


def thinker_handover(engines: EnginePool, stage: StageSpec, params: ARParams, inputs: Mapping[str, object],
                     request_id: str, output: AROutput, *, request: ARRequest | None = None) -> StageValues:
    """The thinker outputs (THINKER_OUTPUTS) a generate stage lists, for the request that made ``output``:
    ``prompt_token_ids`` [L] int64, ``hidden_states`` [L + n, H] and ``token_embeds`` [L + n, H] float32 (n: the
    reply's ``output.token_ids``, its end token included), ``prompt_positions`` [3, L] int64. Call it after the
    stage's generation with the same ``params``, ``inputs`` and ``request_id``; it runs a second pass (the model's
    pooling engine) over prompt + reply with the media. A stage that lists none of them gets {} and nothing runs."""
    import torch

    wanted = [port for port in THINKER_OUTPUTS if port in stage.outputs]
    if not wanted:
        return {}
    engine = engines.ar(stage.model, ar_engine_args(stage))
    encoder = engines.encoder(stage.model, thinker_encoder_args(stage))
    request = request or ar_request(engines, stage, params, inputs, request_id)
    states = thinker_states(engine, encoder, request, output)
    prompt = int(states.prompt_token_ids.numel())
    positions = states.positions if states.positions is not None else torch.arange(prompt).expand(3, -1).clone()
    found: StageValues = {"prompt_token_ids": states.prompt_token_ids, "hidden_states": states.hidden_states,
                          "token_embeds": states.token_embeds, "prompt_positions": positions}
    return {port: found[port] for port in wanted}


def execute_recite(engines: EnginePool, stage: StageSpec, params: StageParams, inputs: Mapping[str, object],
                   request_id: str, progress: ProgressFn) -> StageValues:
    """Text to speech on Qwen2.5-Omni: the thinker takes the prompt as its reply, word for word, to a user turn
    (``instructions``), as if it had written it; its talker then speaks exactly that text. Nothing is sampled: the
    reply's tokens are the text's and the thinker's end token, and the handover's pass reads prompt + reply."""
    import torch

    assert isinstance(params, ARReciteParams)
    text = _prompt(inputs["prompt"])
    engine = engines.ar(stage.model, ar_engine_args(stage))
    eos = talker_eos(engine.model)
    turn = ARParams(max_tokens=1, chat=True, system_prompt=params.system_prompt)
    request = ar_request(engines, stage, turn, {"prompt": params.instructions}, request_id)
    prompt: Mapping[str, Any] = engine.engine_prompt(request)  # type: ignore[assignment]  # a TypedDict of vLLM's
    prompt_ids = (list(prompt["prompt_token_ids"]) if "prompt_token_ids" in prompt
                  else engine.tokenize(str(prompt["prompt"])))
    reply = engine.tokenize(text)
    if not reply:
        raise ValueError("input 'prompt': the text to say tokenizes to no tokens")
    room = engine.max_model_len - len(prompt_ids) - 1
    if len(reply) > room:
        raise ValueError(f"input 'prompt': the text to say is {len(reply)} tokens; this stage takes at most {room} "
                         f"(max_model_len {engine.max_model_len}); split it into several jobs")
    output = AROutput(request_id=request_id, text=text, token_ids=[*reply, eos], prompt_token_ids=prompt_ids,
                      finish_reason="stop")
    progress(0, 1)
    values: StageValues = {"text": text, "token_ids": torch.tensor(output.token_ids, dtype=torch.long)}
    values.update(thinker_handover(engines, stage, turn, {"prompt": params.instructions}, request_id, output,
                                   request=request))
    progress(1, 1)
    return {port: value for port, value in values.items() if port in stage.outputs}


def talker_eos(model_dir: str) -> int:
    """The token a thinker's reply ends with (its first end token: Qwen2.5-Omni's <|im_end|>)."""
    from omni_jobs.engines.talker import thinker_eos_ids

    ids = thinker_eos_ids(model_dir)
    if not ids:
        raise ValueError(f"model {model_dir!r} names no end token (generation_config.json eos_token_id)")
    return ids[0]


def speaker_of(stage: StageSpec, inputs: Mapping[str, object], param: str) -> str:
    """The voice a speech stage speaks in: its ``speaker`` input where it is wired and given, else its parameter."""
    given = inputs.get("speaker")
    if given is None:
        return param
    voice = _prompt(given).strip()
    if not voice:
        raise ValueError(f"stage '{stage.id}' input 'speaker': empty; name one of the checkpoint's voices")
    return voice


def thinker_encoder_args(stage: StageSpec) -> dict[str, JsonValue]:
    """The vLLM arguments of a thinker stage's second pass (its pooling engine): the stage's, without vLLM's media
    processor cache, so that every request's media data reaches the position code (omni_jobs.engines.talker)."""
    return {**ar_engine_args(stage), "mm_processor_cache_gb": 0}


def thinker_states_of(inputs: Mapping[str, object]) -> omni_speech.ThinkerStates:
    """A talk stage's inputs as the thinker's states (shapes checked)."""
    import torch

    positions = inputs.get("prompt_positions")
    if positions is not None and not isinstance(positions, torch.Tensor):
        raise TypeError(f"prompt_positions must be a tensor, got {type(positions).__name__}")
    prompt = code_ids(inputs["prompt_token_ids"], "prompt_token_ids")
    if positions is not None and torch.equal(positions.to(torch.long), torch.arange(prompt.numel()).expand(3, -1)):
        positions = None  # text positions: the talker's own
    states = omni_speech.ThinkerStates(
        prompt_token_ids=prompt, token_ids=code_ids(inputs["token_ids"], "token_ids"),
        hidden_states=_embeds(inputs["hidden_states"]), token_embeds=_embeds(inputs["token_embeds"]),
        positions=positions.to(torch.long) if positions is not None else None)
    states.check()
    return states


def execute_talk(engines: EnginePool, stage: StageSpec, params: StageParams, inputs: Mapping[str, object],
                 request_id: str, progress: ProgressFn, *, policy: BatchPolicy | None = None,
                 on_codes: CodesSoFar | None = None) -> StageValues:
    """Qwen2.5-Omni's talker: the thinker's states (a thinker stage's THINKER_OUTPUTS and reply token_ids) in, speech
    codes out (``audio_codes`` [n] int64, its stop code left out), in the ``speaker``'s voice; batched with other
    jobs' requests through the engine's batcher when a ``policy`` is given. ``on_codes`` gets the codes so far at
    every engine step (for speech streamed while the talker writes: code2wav.Code2WavStream)."""
    import torch

    assert isinstance(params, ARTalkParams)
    engine = engines.ar(stage.model, ar_engine_args(stage))
    talker = Talker(engine)
    sampling = TalkSampling(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                            top_k=params.top_k, repetition_penalty=params.repetition_penalty, seed=params.seed)
    stream = None if on_codes is None else (lambda ids: on_codes(omni_speech.talker_codes(ids, talker.tokens)))
    request = talker.request(request_id, thinker_states_of(inputs), speaker_of(stage, inputs, params.speaker), sampling,
                             on_codes=stream)
    if policy is not None:
        output = ar_batcher(engine, policy).submit(request, progress)
    else:
        (output,) = engine.generate([request], on_progress=lambda _rid, done, total: progress(done, total))
    return {"audio_codes": torch.tensor(talker.codes(output), dtype=torch.long)}


def execute_code2wav(engines: EnginePool, stage: StageSpec, params: StageParams, inputs: Mapping[str, object],
                     request_id: str, progress: ProgressFn, *, policy: BatchPolicy | None = None) -> StageValues:
    """Qwen2.5-Omni's token2wav: ``audio_codes`` in, ``audio`` out (24 kHz mono, 480 samples a code), in the
    ``speaker``'s voice from the ``seed``'s noise; requests of one length and voice share a DiT batch."""
    assert isinstance(params, DiTCode2WavParams)
    engine = engines.code2wav(stage.model, stage.engine_args)
    codes = [int(c) for c in code_ids(inputs["audio_codes"], "audio_codes").tolist()]
    voice = speaker_of(stage, inputs, params.speaker)
    progress(0, params.num_inference_steps)
    if policy is not None and len(codes) <= engine.max_codes:
        clip = code2wav_batcher(engine, policy).submit(Code2WavRequest(
            request_id, tuple(codes), voice, seed=params.seed, num_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale))
    else:
        clip = engine.full(codes, voice, seed=params.seed, num_steps=params.num_inference_steps,
                           guidance_scale=params.guidance_scale)
    progress(params.num_inference_steps, params.num_inference_steps)
    return {"audio": clip}


def code_ids(value: object, port: str) -> torch.Tensor:
    """[n] int64 token ids from a handed-over tensor (or a list)."""
    import torch

    if isinstance(value, list | tuple):
        value = torch.tensor([int(v) for v in value], dtype=torch.long)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{port} must be a tensor of token ids, got {type(value).__name__}")
    if value.is_floating_point() or value.ndim > 2 or (value.ndim == 2 and value.shape[0] != 1):
        raise ValueError(f"{port} must be [n] integer token ids, got {value.dtype} {list(value.shape)}")
    return value.reshape(-1).to(torch.long)


def _dit_engine(engines: EnginePool, stage: StageSpec) -> DiTKind:
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


def dit_submitter(engine: DiTKind, policy: BatchPolicy) -> Batcher[DiTRequest, DiTOutput] | ProcessBatcher:
    """What a DiT stage submits to: an engine process's own batcher, or this process's (``dit_batcher``)."""
    return engine.batcher(policy) if isinstance(engine, DiTEngineProcess) else dit_batcher(engine, policy)


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
        output = dit_submitter(engine, policy).submit(request, progress)
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
