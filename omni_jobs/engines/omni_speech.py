"""Qwen2.5-Omni's speech path, the parts that need no engine: what the thinker hands the talker, how the talker's
rows are built from it (as transformers' ``Qwen2_5OmniForConditionalGeneration.generate`` builds them), the
checkpoint's speakers, and the talker's own config for vLLM.

The talker reads, for every position, ``thinker_to_talker_proj(codec_embedding + thinker_row)``:
- the prompt's rows are the thinker's last hidden state plus its input embedding (zero at media placeholders,
  where transformers zeroes the audio/image/video features), with no codec embedding;
- then the speaker's start token (a thinker embedding row) with ``codec_pad``, and the first reply token's row
  with ``codec_bos`` (the talker's prompt ends there);
- then one row per decode step: the next reply token's, then the text end, then the text pad for ever after.
``talker_rows`` builds them; the vLLM model (omni_jobs.engines.talker_vllm) adds the codec embeddings and the
projection. torch is imported lazily, so this module stays cheap to import.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

TALKER_ARCH = "Qwen2_5OmniTalkerForCodes"
"""The vLLM architecture of the talker (omni_jobs.engines.talker_vllm), registered by ``register_vllm_models``."""
TALKER_EXTRA_ARG = "omni_jobs.talker"
"""The ``SamplingParams.extra_args`` key of a talker request's ``TalkerConditioning``."""
SPEAKERS_FILE = "spk_dict.pt"
THINKER_EMBEDDINGS = "thinker.model.embed_tokens.weight"
SAMPLES_PER_CODE = 480
"""Qwen2.5-Omni's token2wav: 2 mel frames per code (``dit_config.repeats``), 240 samples per frame (BigVGAN)."""
SAMPLE_RATE = 24000


def register_vllm_models() -> None:
    """vLLM general plugin (pyproject.toml): this project's model classes, by name, imported when vLLM needs them
    (in every process vLLM starts, its model-inspection subprocess included)."""
    from vllm import ModelRegistry

    if TALKER_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(TALKER_ARCH, "omni_jobs.engines.talker_vllm:Qwen2_5OmniTalkerForCodes")


def bind_runners(llm: Any) -> None:
    """Bind the talker model of a freshly started engine to its model runner, from which it reads which request
    each scheduled token is (omni_jobs.engines.talker_vllm); any other model is left alone. vLLM's
    ``collective_rpc`` runs it where the model is: in this process in single-process mode."""
    architectures = list(getattr(llm.llm_engine.model_config, "architectures", None) or [])
    if TALKER_ARCH in architectures:
        llm.collective_rpc(_bind_runner)


def _bind_runner(worker: Any) -> None:
    runner = worker.model_runner
    runner.get_model().bind_runner(runner)


@dataclass(frozen=True)
class TalkerConditioning:
    """One talker request's thinker rows, carried in ``SamplingParams.extra_args[TALKER_EXTRA_ARG]``."""

    rows: torch.Tensor
    """[T, E] float32: row ``s`` is added at sequence index ``s`` (past the end, the last row: the text pad)."""
    codec_from: int
    """Sequence indices from here on also take their token's codec embedding (the thinker prompt's do not)."""
    positions: torch.Tensor | None = None
    """[3, P] M-RoPE positions of the first P indices (a prompt with media); None: text positions."""
    position_delta: int = 0
    """Past ``positions``, index ``s`` is at ``s + position_delta``."""


@dataclass(frozen=True)
class ThinkerStates:
    """What the thinker hands the talker, for its prompt and reply tokens (L prompt, n reply, H hidden)."""

    prompt_token_ids: torch.Tensor
    """[L] int64: the thinker's prompt as its engine saw it (media placeholders expanded)."""
    token_ids: torch.Tensor
    """[n] int64: the reply, its end token included when it has one."""
    hidden_states: torch.Tensor
    """[L + n, H] float32: the thinker's last-layer hidden states (after its final norm)."""
    token_embeds: torch.Tensor
    """[L + n, H] float32: its input embeddings, zero at media placeholders."""
    positions: torch.Tensor | None = None
    """[3, L] int64 M-RoPE positions of the prompt when it holds media; None: text positions."""

    def check(self) -> None:
        """Shapes that agree, or a ValueError naming the one that does not."""
        prompt, reply = int(self.prompt_token_ids.numel()), int(self.token_ids.numel())
        if prompt < 1 or reply < 1:
            raise ValueError(f"the thinker's states need a prompt and a reply, got {prompt} and {reply} tokens")
        for name in ("hidden_states", "token_embeds"):
            value = getattr(self, name)
            if value.ndim != 2 or value.shape[0] < prompt + reply - 1:
                raise ValueError(f"{name} must be [prompt + reply tokens, hidden] = [{prompt + reply}, H], "
                                 f"got {list(value.shape)}")
        if self.hidden_states.shape[1] != self.token_embeds.shape[1]:
            raise ValueError(f"hidden_states are {self.hidden_states.shape[1]} wide but token_embeds "
                             f"{self.token_embeds.shape[1]}")
        if self.positions is not None and tuple(self.positions.shape) != (3, prompt):
            raise ValueError(f"positions must be [3, {prompt}], got {list(self.positions.shape)}")


@dataclass(frozen=True)
class TalkerTokens:
    """The talker's token ids and the thinker's, from its config (``talker_config``)."""

    codec_bos: int
    codec_eos: int
    codec_pad: int
    codec_mask: int
    text_eos: int
    text_pad: int
    vocab_size: int

    @classmethod
    def from_config(cls, talker: Mapping[str, Any]) -> TalkerTokens:
        return cls(codec_bos=int(talker["tts_codec_start_token_id"]), codec_eos=int(talker["tts_codec_end_token_id"]),
                   codec_pad=int(talker["tts_codec_pad_token_id"]), codec_mask=int(talker["tts_codec_mask_token_id"]),
                   text_eos=int(talker["tts_text_end_token_id"]), text_pad=int(talker["tts_text_pad_token_id"]),
                   vocab_size=int(talker["vocab_size"]))

    @property
    def stop_codes(self) -> tuple[int, int]:
        """Where the talker stops: transformers' ``talker_eos_token_id`` ([8292, 8294]: codec pad and end)."""
        return (self.codec_pad, self.codec_eos)

    def prompt(self, thinker_prompt_len: int) -> list[int]:
        """The talker's prompt ids: a mask per thinker prompt token, then pad (the speaker) and bos (the reply)."""
        return [self.codec_mask] * thinker_prompt_len + [self.codec_pad, self.codec_bos]


def talker_rows(states: ThinkerStates, *, speaker_bos: torch.Tensor, text_eos: torch.Tensor, text_pad: torch.Tensor,
                thinker_eos_ids: Sequence[int]) -> TalkerConditioning:
    """The talker's rows for one request, as transformers builds ``inputs_embeds`` and ``thinker_reply_part``:
    [prompt states, speaker start, first reply token] then [reply tokens 2..n-1, text end, text pad], where a
    thinker end token (``thinker_eos_ids``) in the reply ends it early (the rows after it are pads)."""
    import torch

    states.check()
    prompt = int(states.prompt_token_ids.numel())
    ids = states.token_ids.reshape(-1).to(torch.long)
    n = int(ids.numel())
    summed = (states.hidden_states.float() + states.token_embeds.float())[: prompt + n]
    width = summed.shape[1]
    for name, row in (("speaker_bos", speaker_bos), ("text_eos", text_eos), ("text_pad", text_pad)):
        if row.numel() != width:
            raise ValueError(f"{name} must be one row of {width}, got shape {list(row.shape)}")
    bos, eos, pad = (r.reshape(1, width).float() for r in (speaker_bos, text_eos, text_pad))
    prefill = torch.cat([summed[:prompt], bos, summed[prompt : prompt + 1]])
    reply = torch.cat([summed[prompt + 1 : prompt + n - 1], eos, pad]) if n > 1 else torch.cat([eos, pad])
    # transformers' rewrite for a reply that ended early: text end right after its last real token, pads after
    stop = torch.as_tensor(list(thinker_eos_ids), dtype=torch.long)
    is_stop = (ids.unsqueeze(-1) == stop).any(-1) if stop.numel() else torch.zeros(n, dtype=torch.bool)
    first = int(torch.where(is_stop, torch.arange(n), n).min().clamp(min=1, max=n - 1))
    at = torch.arange(reply.shape[0]).unsqueeze(-1)
    reply = torch.where(at >= first, pad, reply)
    reply = torch.where(at == first - 1, eos, reply)
    positions, delta = None, 0
    if states.positions is not None:
        positions = torch.cat([states.positions.to(torch.long),
                               states.positions.max() + torch.arange(1, 3).view(1, 2).expand(3, 2)], dim=1)
        delta = int(states.positions.max()) + 1 - prompt
    return TalkerConditioning(rows=torch.cat([prefill, reply]).contiguous(), codec_from=prompt,
                              positions=positions, position_delta=delta)


def talker_codes(token_ids: Sequence[int], tokens: TalkerTokens) -> list[int]:
    """The codes a talker wrote, up to (not including) its first stop code."""
    out: list[int] = []
    for t in token_ids:
        if t in tokens.stop_codes:
            break
        out.append(int(t))
    return out


# --- the checkpoint ---


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"{str(model_dir)!r} has no readable config.json ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")  # noqa: TRY004 - a bad checkpoint, not a bad argument
    return config


def sub_config(model_dir: str | Path, name: str) -> dict[str, Any]:
    """A Qwen2.5-Omni checkpoint's ``talker_config`` or ``token2wav_config``; a clear error for another model."""
    config = read_config(model_dir)
    found = config.get(name)
    if not isinstance(found, dict):
        raise ValueError(  # noqa: TRY004 - the wrong model, not a bad argument
            f"model {str(model_dir)!r} has no {name} (model_type {config.get('model_type')!r}): this stage needs "
            "the whole Qwen2.5-Omni checkpoint (thinker, talker and token2wav)")
    return found


def talker_config_dir(model_dir: str | Path) -> Path:
    """A directory holding the talker's own config.json, for vLLM's ``hf_config_path``: vLLM then sizes its
    vocabulary, hidden size and sampling pads from the talker, not from the thinker that the whole checkpoint's
    config.json leads it to. Content-addressed under the temp directory, so any process may make it."""
    talker = dict(sub_config(model_dir, "talker_config"))
    talker["architectures"] = [TALKER_ARCH]
    talker.setdefault("model_type", "qwen2_5_omni_talker")
    text = json.dumps(talker, indent=2, sort_keys=True) + "\n"
    root = Path(tempfile.gettempdir()) / "omni-jobs-talker-configs" / hashlib.sha256(text.encode()).hexdigest()[:16]
    target = root / "config.json"
    if not target.is_file() or target.read_text(encoding="utf-8") != text:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    return root


def is_talker(engine_args: Mapping[str, Any]) -> bool:
    """Whether a stage's ``engine_args`` run the talker (its ``hf_overrides.architectures`` names it)."""
    overrides = engine_args.get("hf_overrides")
    archs = overrides.get("architectures") if isinstance(overrides, Mapping) else None
    return isinstance(archs, list | tuple) and TALKER_ARCH in archs


def talker_engine_args(model_dir: str, engine_args: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM arguments for a stage whose ``hf_overrides.architectures`` names the talker: its own config
    (``hf_config_path``), no generation defaults from the thinker's generation_config.json, and no prefix caching:
    every talker prompt of one length has the same token ids (codec masks), while its KV cache holds the thinker's
    rows of that request, so a cached prefix would be another request's (vLLM-Omni turns it off too)."""
    args = dict(engine_args)
    if not is_talker(args):
        return args
    if args.get("enable_prefix_caching"):
        raise ValueError("the talker cannot use prefix caching (its prompts' token ids do not say what its KV cache "
                         "holds: each request's thinker rows); leave enable_prefix_caching unset")
    args["enable_prefix_caching"] = False
    args.setdefault("hf_config_path", str(talker_config_dir(model_dir)))
    args.setdefault("generation_config", "vllm")
    return args


@dataclass(frozen=True)
class Speaker:
    """One voice of ``spk_dict.pt``: the talker's start token, token2wav's conditioning and reference mel."""

    name: str
    bos_token: int
    cond: torch.Tensor
    """[1, enc_emb_dim] float32."""
    ref_mel: torch.Tensor
    """[1, frames, mel_dim] float32."""


@lru_cache(maxsize=16)
def _speakers(path: str, mtime: float) -> dict[str, Speaker]:
    import torch

    raw = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a speaker dictionary")  # noqa: TRY004 - a bad checkpoint file
    out: dict[str, Speaker] = {}
    for name, entry in raw.items():
        try:
            out[str(name)] = Speaker(name=str(name), bos_token=int(entry["bos_token"]),
                                     cond=torch.as_tensor(entry["cond"]).float().reshape(1, -1),
                                     ref_mel=torch.as_tensor(entry["ref_mel"]).float().reshape(
                                         1, -1, torch.as_tensor(entry["ref_mel"]).shape[-1]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: speaker {name!r} lacks bos_token, cond or ref_mel ({exc})") from None
    return out


def speakers(model_dir: str | Path) -> dict[str, Speaker]:
    """The checkpoint's voices (``spk_dict.pt``, read with ``weights_only``), by name; read once per process."""
    path = Path(model_dir) / SPEAKERS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"model {str(model_dir)!r} has no {SPEAKERS_FILE}: its voices (Qwen2.5-Omni ships "
                                "Chelsie and Ethan there)")
    return _speakers(str(path), path.stat().st_mtime)


def speaker(model_dir: str | Path, name: str) -> Speaker:
    voices = speakers(model_dir)
    if name not in voices:
        raise ValueError(f"model {str(model_dir)!r} has no speaker {name!r}; it has: {', '.join(sorted(voices))}")
    return voices[name]


def read_rows(model_dir: str | Path, tensor: str, rows: Iterable[int]) -> torch.Tensor:
    """Rows of one (embedding) tensor of the checkpoint, read lazily from its safetensors (not the whole matrix)."""
    import torch
    from safetensors import safe_open

    from omni_jobs.engines.projection import safetensors_shards

    wanted = list(rows)
    for shard in safetensors_shards(Path(model_dir), tensor):
        with safe_open(str(shard), framework="pt") as f:
            if tensor in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                table = f.get_slice(tensor)
                height = int(table.get_shape()[0])
                bad = [r for r in wanted if not 0 <= r < height]
                if bad:
                    raise ValueError(f"rows {bad} are outside {tensor} ({height} rows)")
                return torch.stack([table[r : r + 1][0] for r in wanted]).float()
    raise ValueError(f"the checkpoint {str(model_dir)!r} has no tensor {tensor!r}")
