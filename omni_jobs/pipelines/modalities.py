"""What flows between stages: modalities, and the input/output ports of each engine task.

A stage names its engine kind (``ar`` on vLLM, ``dit`` on diffusers) and the task that engine runs
(``generate``, ``encode``, ``transcribe``, ``talk``, ``text-to-image``, ``image-to-image``, ``text-to-audio``,
``text-to-video``, ``code2wav``). The task fixes
which named inputs the stage consumes and which outputs it can produce, each with a modality.
Pipeline validation checks every wire against these tables, so a DiT stage fed token ids instead
of text, or an audio stage wired into an image input, is an error at load time, not a crash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

EngineKind = Literal["ar", "dit"]
Modality = Literal["text", "token_ids", "hidden_states", "prompt_embeds", "latents", "audio_codes", "image", "audio",
                   "video"]

MODALITIES: tuple[Modality, ...] = (
    "text", "token_ids", "hidden_states", "prompt_embeds", "latents", "audio_codes", "image", "audio", "video",
)
TENSOR_MODALITIES: frozenset[Modality] = frozenset(
    {"token_ids", "hidden_states", "prompt_embeds", "latents", "audio_codes"})
"""Handed over as safetensors. ``audio_codes`` are a speech codec's token ids ([n] int64: what a talker writes and
a code-to-waveform stage reads), a modality of their own so that a text model's token ids cannot be wired there."""
MEDIA_MODALITIES: frozenset[Modality] = frozenset({"image", "audio", "video"})
"""What a multimodal AR stage hands vLLM as ``multi_modal_data`` (its port names are the modalities)."""
MEDIA_PORTS: frozenset[str] = frozenset(MEDIA_MODALITIES)


@dataclass(frozen=True)
class EnginePorts:
    """Named inputs an engine task consumes (each accepting some modalities) and the outputs it offers.

    ``exclusive`` lists groups of inputs of which exactly one must be wired (a DiT is conditioned
    either on text, which its own text encoder embeds, or on prompt embeddings made upstream).
    ``default_outputs`` are produced when a stage does not list its ``outputs``.
    """

    inputs: dict[str, tuple[Modality, ...]]
    outputs: dict[str, Modality]
    default_outputs: tuple[str, ...]
    required_inputs: frozenset[str] = frozenset()
    exclusive: tuple[frozenset[str], ...] = field(default=())
    many: frozenset[str] = frozenset()
    """Inputs that may be wired to a list of sources (``image: [input.front, input.back]``): a
    vision-language model takes several images in one prompt."""
    description: str = ""


THINKER_OUTPUTS: dict[str, Modality] = {
    "prompt_token_ids": "token_ids", "hidden_states": "hidden_states", "token_embeds": "prompt_embeds",
    "prompt_positions": "token_ids",
}
"""What a thinker stage (AR generate) hands its talker beside its reply's ``token_ids``, for its L prompt and
n reply tokens: the prompt's token ids as the engine saw them [L] (media placeholders expanded), the last layer's
hidden states [L + n, hidden], the input embeddings [L + n, hidden] (zero at media placeholders) and the prompt's
M-RoPE positions [3, L] (images and videos sit on a grid; text and audio count on)."""

ENGINE_TASKS: dict[EngineKind, dict[str, EnginePorts]] = {
    "ar": {
        "generate": EnginePorts(
            inputs={"prompt": ("text",), "prompt_embeds": ("hidden_states", "prompt_embeds"),
                    "image": ("image",), "audio": ("audio",), "video": ("video",)},
            exclusive=(frozenset({"prompt", "prompt_embeds"}),),
            many=MEDIA_PORTS,
            outputs={"text": "text", "token_ids": "token_ids", **THINKER_OUTPUTS},
            default_outputs=("text", "token_ids"),
            description="vLLM generates a continuation of the prompt: text, with the images, audio and video "
                        "a multimodal model takes (multi_modal_data), or upstream embeddings (prompt_embeds). "
                        "A Qwen2.5-Omni thinker also hands its talker what it reads: prompt_token_ids, "
                        "hidden_states and token_embeds of prompt + reply (a second pass on vLLM's pooling runner).",
        ),
        "recite": EnginePorts(
            inputs={"prompt": ("text",)},
            required_inputs=frozenset({"prompt"}),
            outputs={"text": "text", "token_ids": "token_ids", **THINKER_OUTPUTS},
            default_outputs=("text", "token_ids"),
            description="A Qwen2.5-Omni thinker takes the prompt as its own reply, word for word (text to speech): "
                        "no sampling, only the pass that hands its talker the states of prompt + reply.",
        ),
        "talk": EnginePorts(
            inputs={"token_ids": ("token_ids",), "prompt_token_ids": ("token_ids",),
                    "hidden_states": ("hidden_states",), "token_embeds": ("prompt_embeds",),
                    "prompt_positions": ("token_ids",), "speaker": ("text",)},
            required_inputs=frozenset({"token_ids", "prompt_token_ids", "hidden_states", "token_embeds"}),
            outputs={"audio_codes": "audio_codes"},
            default_outputs=("audio_codes",),
            description="Qwen2.5-Omni's talker on vLLM writes speech codec codes for the thinker's reply, fed as "
                        "the real model feeds it (the thinker's states of the prompt, then of one reply token per "
                        "step), in a voice of the checkpoint (the speaker input, else the speaker parameter). "
                        "prompt_positions: needed where the thinker's prompt held images or videos (else text "
                        "positions).",
        ),
        "transcribe": EnginePorts(
            inputs={"audio": ("audio",), "prompt": ("text",)},
            required_inputs=frozenset({"audio"}),
            outputs={"text": "text"},
            default_outputs=("text",),
            description="A speech-to-text model on vLLM (Whisper and the like) transcribes or translates the audio; "
                        "the prompt, if any, is the text that came before it.",
        ),
        "encode": EnginePorts(
            inputs={"prompt": ("text",)},
            required_inputs=frozenset({"prompt"}),
            outputs={"hidden_states": "hidden_states"},
            default_outputs=("hidden_states",),
            description="vLLM's pooling runner returns the last layer's per-token hidden states [tokens, hidden].",
        ),
    },
    "dit": {
        "text-to-image": EnginePorts(
            inputs={"prompt": ("text",), "prompt_embeds": ("hidden_states", "prompt_embeds")},
            exclusive=(frozenset({"prompt", "prompt_embeds"}),),
            outputs={"image": "image", "latents": "latents"},
            default_outputs=("image",),
            description="A diffusers text-to-image pipeline, conditioned on text or on upstream prompt embeddings.",
        ),
        "image-to-image": EnginePorts(
            inputs={"prompt": ("text",), "image": ("image",)},
            required_inputs=frozenset({"prompt", "image"}),
            outputs={"image": "image", "latents": "latents"},
            default_outputs=("image",),
            description="A diffusers image-to-image pipeline edits the image as the prompt says.",
        ),
        "text-to-audio": EnginePorts(
            inputs={"prompt": ("text",)},
            required_inputs=frozenset({"prompt"}),
            outputs={"audio": "audio"},
            default_outputs=("audio",),
            description="A diffusers text-to-audio pipeline (StableAudio family) renders a waveform.",
        ),
        "text-to-video": EnginePorts(
            inputs={"prompt": ("text",)},
            required_inputs=frozenset({"prompt"}),
            outputs={"video": "video", "latents": "latents"},
            default_outputs=("video",),
            description="A diffusers text-to-video pipeline (Wan family) renders frames, handed over as MP4.",
        ),
        "code2wav": EnginePorts(
            inputs={"audio_codes": ("audio_codes",), "speaker": ("text",)},
            required_inputs=frozenset({"audio_codes"}),
            outputs={"audio": "audio"},
            default_outputs=("audio",),
            description="Qwen2.5-Omni's token2wav (a flow-matching DiT, then BigVGAN) renders speech codes as "
                        "24 kHz audio (480 samples a code) in the speaker's voice (the speaker input, else the "
                        "speaker parameter: the talker's).",
        ),
    },
}

STREAMED_OUTPUTS: dict[tuple[EngineKind, str], frozenset[str]] = {("ar", "talk"): frozenset({"audio_codes"})}
"""Outputs a task publishes while it runs (``output.delta`` events), so that a stage downstream can start beside it
and read them as they come (its ``stream_input``): a talker's speech codes."""

STREAMING_INPUTS: dict[tuple[EngineKind, str], frozenset[str]] = {("dit", "code2wav"): frozenset({"audio_codes"})}
"""Inputs a task can read while its upstream still writes them: code2wav renders the codes in chunks as they come."""

DEFAULT_TASK: dict[EngineKind, str] = {"ar": "generate", "dit": "text-to-image"}

ENGINE_PORTS: dict[EngineKind, EnginePorts] = {kind: ENGINE_TASKS[kind][DEFAULT_TASK[kind]] for kind in ENGINE_TASKS}
"""The ports of each engine kind's default task."""


def engine_ports(engine: EngineKind, task: str | None = None) -> EnginePorts:
    """The ports of ``task`` on ``engine`` (its default task when None); KeyError names the valid tasks."""
    tasks = ENGINE_TASKS[engine]
    name = task or DEFAULT_TASK[engine]
    if name not in tasks:
        raise KeyError(f"engine '{engine}' has no task '{name}'; tasks: {sorted(tasks)}")
    return tasks[name]


# --- final outputs: one type per output handler of the results step ---
OUTPUT_TYPES: tuple[str, ...] = (*MODALITIES, "text+image")
"""Types a pipeline output may have: one modality, or a combination the results step can bundle."""


def output_type(modalities: Sequence[Modality]) -> str:
    """``['text', 'image']`` -> ``'text+image'``: the type of an output made of several stage outputs."""
    return "+".join(modalities)
