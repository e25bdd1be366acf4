"""What flows between stages: modalities, and the input/output ports of each engine task.

A stage names its engine kind (``ar`` on vLLM, ``dit`` on diffusers) and the task that engine runs
(``generate``, ``encode``, ``transcribe``, ``text-to-image``, ``image-to-image``, ``text-to-audio``, ``text-to-video``). The task fixes
which named inputs the stage consumes and which outputs it can produce, each with a modality.
Pipeline validation checks every wire against these tables, so a DiT stage fed token ids instead
of text, or an audio stage wired into an image input, is an error at load time, not a crash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

EngineKind = Literal["ar", "dit"]
Modality = Literal["text", "token_ids", "hidden_states", "prompt_embeds", "latents", "image", "audio", "video"]

MODALITIES: tuple[Modality, ...] = (
    "text", "token_ids", "hidden_states", "prompt_embeds", "latents", "image", "audio", "video",
)
TENSOR_MODALITIES: frozenset[Modality] = frozenset({"token_ids", "hidden_states", "prompt_embeds", "latents"})
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


ENGINE_TASKS: dict[EngineKind, dict[str, EnginePorts]] = {
    "ar": {
        "generate": EnginePorts(
            inputs={"prompt": ("text",), "prompt_embeds": ("hidden_states", "prompt_embeds"),
                    "image": ("image",), "audio": ("audio",), "video": ("video",)},
            exclusive=(frozenset({"prompt", "prompt_embeds"}),),
            many=MEDIA_PORTS,
            outputs={"text": "text", "token_ids": "token_ids"},
            default_outputs=("text", "token_ids"),
            description="vLLM generates a continuation of the prompt: text, with the images, audio and video "
                        "a multimodal model takes (multi_modal_data), or upstream embeddings (prompt_embeds).",
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
    },
}

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
