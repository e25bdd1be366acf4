"""The AR encoder engine: a vLLM pooling runner that turns prompts into per-token hidden states.

The Qwen-Image / BAGEL pattern uses an LLM as the DiT's text encoder: the LLM's last-layer hidden
state of every prompt token becomes the DiT's prompt embeddings. A vLLM engine built with
``runner="pooling"`` and the ``token_embed`` task returns exactly that ([tokens, hidden] per prompt);
such an engine cannot generate, so a worker that serves both tasks keeps two engines on one model.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omni_jobs.core import telemetry
from omni_jobs.core.json_types import JsonValue
from omni_jobs.engines.ar import build_llm
from omni_jobs.engines.turns import engine_turn

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class EncodeRequest:
    request_id: str
    prompt: str
    engine_prompt: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    """A prompt vLLM takes as it is (token ids with the media they hold), instead of ``prompt``'s text: the
    thinker's prompt and reply, for the hidden states it hands its talker."""


@dataclass(frozen=True)
class EncodeOutput:
    request_id: str
    hidden_states: torch.Tensor
    """float32, [prompt tokens, hidden_size], on the CPU."""
    token_ids: list[int]
    """The prompt's token ids as the engine saw them (media placeholders expanded)."""


class AREncoder:
    """One vLLM pooling engine in single-process mode, encoding batches of prompts in one call."""

    def __init__(
        self,
        model: str,
        *,
        engine_args: Mapping[str, JsonValue] | None = None,
        kv_cache_bytes: int = 256 * 2**20,
        max_model_len: int = 512,
    ) -> None:
        from vllm.config import PoolerConfig

        self.model = model
        self._llm = build_llm(model, engine_args, kv_cache_bytes=kv_cache_bytes, max_model_len=max_model_len,
                              runner="pooling", pooler_config=PoolerConfig(task="token_embed"))
        self._tokenizer = self._llm.get_tokenizer()
        model_config = self._llm.llm_engine.model_config
        self.max_model_len: int = int(model_config.max_model_len)
        self.hidden_size: int = int(model_config.get_hidden_size())
        self._lock = threading.Lock()

    def _prompt_ids(self, request: EncodeRequest) -> list[int]:
        ids = list(self._tokenizer.encode(request.prompt))
        if not ids:
            raise ValueError(f"request {request.request_id!r}: the prompt tokenizes to no tokens")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt is {len(ids)} tokens, more than max_model_len "
                f"{self.max_model_len}"
            )
        return ids

    def encode(self, requests: Sequence[EncodeRequest]) -> list[EncodeOutput]:
        """Hidden states of every request in ONE ``LLM.encode`` call; outputs in request order."""
        if not requests:
            return []
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        prompts: list[Any] = [dict(r.engine_prompt) if r.engine_prompt is not None
                              else TokensPrompt(prompt_token_ids=self._prompt_ids(r)) for r in requests]
        with self._lock, engine_turn():  # on shared CPU cores, one engine at a time (engines.turns)
            telemetry.batch("ar-encode", len(requests))
            results = self._llm.encode(
                prompts, pooling_task="token_embed", pooling_params=PoolingParams(use_activation=False),
                use_tqdm=False,
            )
        if len(results) != len(requests):
            raise RuntimeError(f"vLLM returned {len(results)} outputs for {len(requests)} requests")
        outputs = []
        for request, result in zip(requests, results, strict=True):
            token_ids = list(result.prompt_token_ids)
            hidden = result.outputs.data.detach().to("cpu").float().contiguous()
            if hidden.shape != (len(token_ids), self.hidden_size):
                raise RuntimeError(
                    f"vLLM pooled {tuple(hidden.shape)} for {len(token_ids)} tokens x hidden {self.hidden_size}"
                )
            outputs.append(EncodeOutput(request.request_id, hidden, token_ids))
        return outputs

    def embed_tokens(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The model's input embedding of each token id, [tokens, hidden] float32 (no media features: a media
        placeholder gets its token's row), from the loaded model itself (vLLM's ``apply_model``)."""
        import torch

        ids = torch.as_tensor(list(token_ids), dtype=torch.long)

        def embed(model: Any) -> torch.Tensor:
            with torch.no_grad():
                found: torch.Tensor = model.embed_input_ids(ids).detach().to("cpu").float()
                return found

        with self._lock:
            (rows,) = self._llm.apply_model(embed)
        if rows.shape != (len(ids), self.hidden_size):
            raise RuntimeError(f"vLLM embedded {len(ids)} tokens as {tuple(rows.shape)}, not [{len(ids)}, "
                               f"{self.hidden_size}]")
        return rows

    def mrope_positions(self, prompt: Mapping[str, Any]) -> tuple[torch.Tensor, int] | None:
        """The M-RoPE positions [3, tokens] and delta that this model gives ``prompt`` (token ids with their media),
        from vLLM's own processor (the media's grids) and model class; None for a model without M-RoPE, or where
        the processor hands over no media data. Start the engine with ``mm_processor_cache_gb: 0``: a processor
        cache would answer the media's second processing (this one, then the pass's) without their data."""
        from vllm import PoolingParams

        engine = self._llm.llm_engine
        if not engine.model_config.uses_mrope:
            return None
        with self._lock:
            request = engine.input_processor.process_inputs(
                "omni-positions", dict(prompt), PoolingParams(task="token_embed"),  # type: ignore[arg-type]  # vLLM types the prompt as its own TypedDict union
                supported_tasks=engine.get_supported_tasks())
        features = [f for f in request.mm_features or [] if f.modality != "prompt_embeds"]
        if any(f.data is None for f in features):
            return None
        ids = list(request.prompt_token_ids or [])

        def positions(model: Any) -> tuple[torch.Tensor, int]:
            found: tuple[torch.Tensor, int] = model.get_mrope_input_positions(ids, features)
            return found

        with self._lock:
            (found,) = self._llm.apply_model(positions)
        return found
