"""What flows between stages: modalities, and the input/output ports each engine kind offers.

A pipeline wires ports together; validation checks every wire against these tables, so a DiT
stage fed token ids instead of text is an error at load time, not a crash at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EngineKind = Literal["ar", "dit"]
Modality = Literal["text", "token_ids", "hidden_states", "prompt_embeds", "latents", "image", "audio"]

MODALITIES: tuple[Modality, ...] = ("text", "token_ids", "hidden_states", "prompt_embeds", "latents", "image", "audio")


@dataclass(frozen=True)
class EnginePorts:
    """Named inputs an engine kind consumes and named outputs it produces, with their modality."""

    inputs: dict[str, Modality]
    required_inputs: frozenset[str]
    outputs: dict[str, Modality]


ENGINE_PORTS: dict[EngineKind, EnginePorts] = {
    "ar": EnginePorts(
        inputs={"prompt": "text"},
        required_inputs=frozenset({"prompt"}),
        outputs={"text": "text", "token_ids": "token_ids"},
    ),
    "dit": EnginePorts(
        inputs={"prompt": "text"},
        required_inputs=frozenset({"prompt"}),
        outputs={"image": "image"},
    ),
}
