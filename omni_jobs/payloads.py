"""How each modality is written down when one stage hands it to the next.

One table: modality -> file format. Tensors are safetensors, images PNG, text JSON; nothing is
pickled. Stage code calls encode/decode and never picks a format itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_jobs.artifacts import codecs
from omni_jobs.pipelines.modalities import Modality


@dataclass(frozen=True)
class PayloadFormat:
    extension: str
    media_type: str


SAFETENSORS = PayloadFormat("safetensors", "application/vnd.safetensors")
FORMATS: dict[Modality, PayloadFormat] = {
    "text": PayloadFormat("json", "application/json"),
    "token_ids": SAFETENSORS,
    "hidden_states": SAFETENSORS,
    "prompt_embeds": SAFETENSORS,
    "latents": SAFETENSORS,
    "image": PayloadFormat("png", "image/png"),
    "audio": PayloadFormat("wav", "audio/wav"),
}


def encode_payload(modality: Modality, value: Any) -> bytes:
    """text: str; token_ids: list[int] or tensor; tensors: tensor; image: PIL image."""
    if modality == "text":
        return codecs.encode_json({"text": value})
    if modality == "token_ids":
        import torch

        tensor = value if isinstance(value, torch.Tensor) else torch.tensor(list(value), dtype=torch.int64)
        return codecs.encode_tensors({"token_ids": tensor})
    if modality in ("hidden_states", "prompt_embeds", "latents"):
        return codecs.encode_tensors({modality: value})
    if modality == "image":
        return codecs.encode_png(value)
    raise ValueError(f"no encoder for modality '{modality}'")


def decode_payload(modality: Modality, data: bytes) -> Any:
    if modality == "text":
        return str(codecs.decode_json(data)["text"])
    if modality == "token_ids":
        return codecs.decode_tensors(data)["token_ids"]
    if modality in ("hidden_states", "prompt_embeds", "latents"):
        return codecs.decode_tensors(data)[modality]
    if modality == "image":
        return codecs.decode_png(data)
    raise ValueError(f"no decoder for modality '{modality}'")
