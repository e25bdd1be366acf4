"""Qwen2.5-Omni's thinker -> talker hand-over, and the talker on vLLM, as the stages call them.

The thinker stage generates text as any AR stage does (vLLM, media in). To speak it, it hands the talker its
states (``thinker_states``): a second pass over prompt + reply on the same checkpoint's pooling engine (vLLM's
``token_embed`` task: the last layer's hidden state of every token, with the media again, so the media positions
are what the thinker saw), and the thinker's input embedding of every token (zero at media placeholders, as
transformers hands them over). The talker stage (``Talker``) builds its rows from them (omni_speech.talker_rows)
and runs them on the vLLM talker (omni_jobs.engines.talker_vllm), batched with other jobs' like any AR request.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omni_jobs.engines import omni_speech
from omni_jobs.engines.ar import AREngine, AROutput, ARRequest, SamplingOptions, TokensSoFar
from omni_jobs.engines.encoder import AREncoder, EncodeRequest
from omni_jobs.engines.omni_speech import ThinkerStates

if TYPE_CHECKING:
    import torch

MEDIA_TOKEN_KEYS = ("audio_token_index", "image_token_index", "video_token_index")
"""thinker_config keys of the placeholder tokens whose input embeddings transformers zeroes for the talker."""


def media_token_ids(model_dir: str) -> frozenset[int]:
    """The thinker's media placeholder token ids (none for a model without a ``thinker_config``)."""
    config = omni_speech.read_config(model_dir)
    thinker = config.get("thinker_config")
    if not isinstance(thinker, dict):
        return frozenset()
    return frozenset(int(thinker[k]) for k in MEDIA_TOKEN_KEYS if isinstance(thinker.get(k), int))


def thinker_states(engine: AREngine, encoder: AREncoder, request: ARRequest, output: AROutput) -> ThinkerStates:
    """What the thinker hands its talker for one generated request: ``output`` came from ``engine`` for
    ``request``; ``encoder`` is the same checkpoint's pooling engine. Its prompt is the one vLLM expanded (media
    placeholders and all), checked against the generating pass's."""
    import torch

    prompt: Mapping[str, Any] = engine.engine_prompt(request)  # type: ignore[assignment]  # a TypedDict of vLLM's
    if "prompt_embeds" in prompt:
        raise ValueError(f"request {request.request_id!r}: a thinker fed prompt_embeds has no prompt tokens to hand "
                         "its talker")
    ids = list(prompt["prompt_token_ids"]) if "prompt_token_ids" in prompt else engine.tokenize(str(prompt["prompt"]))
    reply = list(output.token_ids)
    if not reply:
        raise ValueError(f"request {request.request_id!r}: the thinker wrote no token to speak")
    second: dict[str, Any] = {"prompt_token_ids": ids + reply}
    if "multi_modal_data" in prompt:
        second["multi_modal_data"] = prompt["multi_modal_data"]
    (encoded,) = encoder.encode([EncodeRequest(request_id=request.request_id, prompt="", engine_prompt=second)])
    expected = list(output.prompt_token_ids) + reply
    if encoded.token_ids != expected:
        raise RuntimeError(f"request {request.request_id!r}: the thinker's second pass saw {len(encoded.token_ids)} "
                           f"tokens, the generating pass {len(expected)}; the prompts differ")
    prompt_len = len(output.prompt_token_ids)
    embeds = encoder.embed_tokens(expected)
    media = media_token_ids(engine.model)
    if media:
        at = torch.tensor([i < prompt_len and t in media for i, t in enumerate(expected)], dtype=torch.bool)
        embeds[at] = 0.0
    positions = None
    if any(modality in ("image", "video") for modality in second.get("multi_modal_data") or {}):
        # images and videos sit on a 3-D grid of positions (audio and text count on): the talker's are the thinker's
        found = encoder.mrope_positions({"prompt_token_ids": ids, "multi_modal_data": second["multi_modal_data"]})
        if found is None:
            raise RuntimeError(f"request {request.request_id!r}: vLLM gave no M-RoPE positions for the thinker's "
                               "prompt with its images or videos")
        positions = found[0][:, :prompt_len].to(torch.long).contiguous()
    states = ThinkerStates(prompt_token_ids=torch.tensor(output.prompt_token_ids, dtype=torch.long),
                           token_ids=torch.tensor(reply, dtype=torch.long), hidden_states=encoded.hidden_states,
                           token_embeds=embeds, positions=positions)
    states.check()
    return states


@dataclass(frozen=True)
class TalkSampling:
    """How the talker samples (Qwen2.5-Omni's generate defaults: 0.9, 0.8, 40, 1.05)."""

    max_tokens: int = 1024
    temperature: float = 0.9
    top_p: float = 0.8
    top_k: int = 40
    repetition_penalty: float = 1.05
    seed: int | None = None


class Talker:
    """The talker of one whole Qwen2.5-Omni checkpoint, on an AREngine started with the talker's architecture
    (``talker_engine_args``): requests from the thinker's states, codes from its outputs."""

    def __init__(self, engine: AREngine) -> None:
        if omni_speech.TALKER_ARCH not in engine.architectures:
            raise ValueError(f"engine of {engine.model!r} runs {engine.architectures}, not the talker "
                             f"({omni_speech.TALKER_ARCH}); start it with talker_engine_args")
        self.engine = engine
        self.model_dir = engine.model
        self.tokens = omni_speech.TalkerTokens.from_config(omni_speech.sub_config(self.model_dir, "talker_config"))
        self.thinker_eos_ids = thinker_eos_ids(self.model_dir)

    def _text_rows(self, speaker: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The thinker's embeddings of the speaker's start token, the text end and the text pad."""
        bos = omni_speech.speaker(self.model_dir, speaker).bos_token
        rows = _embedding_rows(self.model_dir, (bos, self.tokens.text_eos, self.tokens.text_pad))
        return rows[0], rows[1], rows[2]

    def request(self, request_id: str, states: ThinkerStates, speaker: str, sampling: TalkSampling, *,
                on_codes: TokensSoFar | None = None) -> ARRequest:
        """The engine request that speaks ``states`` in ``speaker``'s voice (its codes end before a stop code)."""
        from vllm.inputs import TokensPrompt

        bos, eos, pad = self._text_rows(speaker)
        cond = omni_speech.talker_rows(states, speaker_bos=bos, text_eos=eos, text_pad=pad,
                                       thinker_eos_ids=self.thinker_eos_ids)
        prompt = self.tokens.prompt(int(states.prompt_token_ids.numel()))
        if len(prompt) >= self.engine.max_model_len:
            raise ValueError(f"request {request_id!r}: the talker's prompt is {len(prompt)} tokens (the thinker's "
                             f"prompt + 2), max_model_len is {self.engine.max_model_len}")
        max_tokens = min(sampling.max_tokens, self.engine.max_model_len - len(prompt))
        return ARRequest(
            request_id=request_id, prompt="", engine_prompt=TokensPrompt(prompt_token_ids=prompt),
            sampling=SamplingOptions(max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                                     top_k=sampling.top_k, seed=sampling.seed,
                                     repetition_penalty=sampling.repetition_penalty,
                                     stop_token_ids=self.tokens.stop_codes, detokenize=False),
            extra_args={omni_speech.TALKER_EXTRA_ARG: cond}, on_tokens=on_codes,
        )

    def codes(self, output: AROutput) -> list[int]:
        """The codes of a finished request, its stop code left out."""
        return omni_speech.talker_codes(output.token_ids, self.tokens)

    def speak(self, requests: Sequence[tuple[str, ThinkerStates, str]], sampling: TalkSampling) -> list[list[int]]:
        """(request id, states, speaker) -> codes, as one engine batch (no streaming: tests, the in-process path)."""
        outputs = self.engine.generate([self.request(rid, states, voice, sampling) for rid, states, voice in requests])
        return [self.codes(o) for o in outputs]


def thinker_eos_ids(model_dir: str) -> tuple[int, ...]:
    """The thinker's end tokens (generation_config.json's ``eos_token_id``, else its text config's)."""
    import json
    from pathlib import Path

    found: object = None
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        found = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    if found is None:
        thinker = omni_speech.read_config(model_dir).get("thinker_config") or {}
        text = thinker.get("text_config") if isinstance(thinker, dict) else None
        found = text.get("eos_token_id") if isinstance(text, dict) else None
    values: list[Any] = found if isinstance(found, list) else [found] if found is not None else []
    return tuple(int(v) for v in values)


@functools.lru_cache(maxsize=64)
def _embedding_rows(model_dir: str, ids: tuple[int, ...]) -> torch.Tensor:
    return omni_speech.read_rows(model_dir, omni_speech.THINKER_EMBEDDINGS, ids)
