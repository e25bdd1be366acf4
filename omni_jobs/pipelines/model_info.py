"""What a pipeline can know about its models before loading them: sizes that must agree across a wire.

An AR encode stage hands its hidden states to a DiT as prompt embeddings, so the LLM's hidden size
must equal the embedding size the DiT's transformer takes. Both are in the models' configs: for
ids of a registered source (``tiny:``) its facts say them without building anything, for local directories they are read
from ``config.json`` / ``transformer/config.json`` / ``model_index.json``. A hub id or a path
that is not on this machine yields nothing here, and the check happens when the engine loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from omni_jobs.core.json_types import JsonObject
from omni_jobs.pipelines.modalities import EngineKind
from omni_jobs.pipelines.model_source import source_facts

DIT_EMBED_KEYS = ("caption_channels", "joint_attention_dim", "cross_attention_dim")
"""Transformer config keys that give the prompt-embedding size (PixArt/Sana; SD3/Flux/Chroma/Qwen-Image; UNets)."""


@dataclass(frozen=True)
class ModelFacts:
    """What is known about one model; None means unknown here (checked when the engine loads)."""

    hidden_size: int | None = None
    """AR models: the size of each token's hidden state (what an encode stage hands over)."""
    prompt_embed_dim: int | None = None
    """DiT models: the size of the prompt embeddings the transformer takes."""
    embed_dim_source: str = ""
    """Which config key gave prompt_embed_dim or hidden_size (for error messages)."""
    text_encoder: bool | None = None
    """DiT models: whether the pipeline has a text encoder of its own."""


def _read_json(path: Path) -> JsonObject | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@lru_cache(maxsize=256)
def _local_facts(engine: EngineKind, directory: str) -> ModelFacts:
    root = Path(directory)
    if engine == "ar":
        config = _read_json(root / "config.json") or {}
        thinker = config.get("thinker_config")  # Qwen2.5-Omni: vLLM serves the thinker of the whole checkpoint
        if isinstance(thinker, dict):
            config = thinker
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        size = text.get("hidden_size") if isinstance(text, dict) else None
        return ModelFacts(hidden_size=size if isinstance(size, int) else None, embed_dim_source="hidden_size")
    index = _read_json(root / "model_index.json") or {}
    has_encoder: bool | None = None
    if "text_encoder" in index:
        entry = index["text_encoder"]
        has_encoder = isinstance(entry, list) and entry[:1] != [None]
    transformer = _read_json(root / "transformer" / "config.json") or {}
    for key in DIT_EMBED_KEYS:
        dim = transformer.get(key)
        if isinstance(dim, int):
            return ModelFacts(prompt_embed_dim=dim, embed_dim_source=key, text_encoder=has_encoder)
    return ModelFacts(text_encoder=has_encoder)


def model_facts(engine: EngineKind, model: str) -> ModelFacts:
    """Facts about ``model`` for an engine of kind ``engine``; empty when nothing is knowable here."""
    info = source_facts(model)
    if info is not None:
        hidden = info.get("hidden_size")
        dim = info.get("prompt_embed_dim")
        encoder = info.get("text_encoder")
        return ModelFacts(
            hidden_size=hidden if isinstance(hidden, int) and engine == "ar" else None,
            prompt_embed_dim=dim if isinstance(dim, int) and engine == "dit" else None,
            embed_dim_source="hidden_size" if engine == "ar" else str(info.get("embed_key", "")),
            text_encoder=encoder if isinstance(encoder, bool) and engine == "dit" else None,
        )
    path = Path(model).expanduser()
    if not path.is_dir():
        return ModelFacts()
    return _local_facts(engine, str(path.resolve()))
