"""A linear projection read from a checkpoint: how one model's hidden states become another's input embeddings.

Qwen2.5-Omni's talker reads the thinker's hidden states through ``thinker_to_talker_proj``, a
``torch.nn.Linear`` stored in the talker's weights; a pipeline names such a layer (the checkpoint and
the tensors' prefix) and the stage applies it to its ``prompt_embeds`` before its engine takes them.
Only the two tensors are read (safetensors opens lazily), not the whole checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Projection:
    """``y = x @ weight.T + bias``: [tokens, in] -> [tokens, out]."""

    name: str
    weight: torch.Tensor
    bias: torch.Tensor | None

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        if x.ndim == 3 and x.shape[0] == 1:
            x = x[0]
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"projection {self.name!r} maps [tokens, {self.in_features}] to "
                             f"[tokens, {self.out_features}], got shape {list(x.shape)}")
        with torch.no_grad():
            return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias)


def safetensors_shards(root: Path, tensor: str) -> list[Path]:
    """The safetensors files that may hold ``tensor``: the one the index names, or every file."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        if tensor in weight_map:
            return [root / weight_map[tensor]]
    return sorted(root.glob("*.safetensors"))


def _read(root: Path, tensor: str) -> torch.Tensor | None:
    from safetensors import safe_open

    for shard in safetensors_shards(root, tensor):
        with safe_open(str(shard), framework="pt") as f:
            if tensor in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                found: torch.Tensor = f.get_tensor(tensor)
                return found
    return None


def _from_hub(model: str) -> Path:
    """A hub id's local snapshot (its configs and weights), where a hub is reachable."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # noqa: BLE001 - offline, unknown repo, bad id: one clear error
        raise FileNotFoundError(f"projection checkpoint {model!r} is not a local directory, and the hub "
                                f"could not give it: {exc}") from None


def load_projection(model_dir: str | Path, name: str) -> Projection:
    """The Linear ``name`` (``<name>.weight``, optional ``<name>.bias``) of the checkpoint in ``model_dir``."""
    root = Path(model_dir)
    if not root.is_dir():
        root = _from_hub(str(model_dir))
    weight = _read(root, f"{name}.weight")
    if weight is None:
        raise ValueError(f"the checkpoint {str(model_dir)!r} has no tensor '{name}.weight'")
    if weight.ndim != 2:
        raise ValueError(f"'{name}.weight' is shaped {list(weight.shape)}, not a Linear's [out, in]")
    return Projection(name=name, weight=weight.float(), bias=(b.float() if (b := _read(root, f"{name}.bias"))
                                                               is not None else None))
