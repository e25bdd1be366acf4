"""Qwen2.5-Omni's talker as a vLLM model: codec codes from the thinker's states, fed as transformers feeds them.

The talker's input at every position is ``thinker_to_talker_proj(codec_embedding + thinker_row)``. Its prefill
rows are the thinker's prompt states (then the speaker's start and the first reply token), and at every decode
step it adds the thinker's next reply row, which ``prompt_embeds`` cannot carry (they cover the prefill only).
So each request carries its rows as a ``TalkerConditioning`` in ``SamplingParams.extra_args``, and this model,
bound to its model runner (``bind_runner``, called by the engine after vLLM starts), looks up which request and
which sequence index each scheduled token is, and adds that row. The request's prompt token ids are the
talker's own (``codec_mask`` x prompt, ``codec_pad``, ``codec_bos``), so vLLM's repetition penalty sees what
transformers' does.

vLLM serves it from the whole checkpoint: ``hf_config_path`` names a directory with the talker's own config
(omni_jobs.engines.omni_speech.talker_config_dir: vocabulary, sizes and sampling pads are the talker's), the
weights are the checkpoint's ``talker.*`` (the thinker's and token2wav's are skipped), and
``hf_overrides: {architectures: [Qwen2_5OmniTalkerForCodes]}`` selects this class, registered by the
``vllm.general_plugins`` entry point (omni_jobs.engines.omni_speech.register_vllm_models).

Written against vLLM 0.32's model runner (``input_batch``, ``requests``, ``query_start_loc``); a runner
without them fails the first step with a clear error rather than generating unconditioned codes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.qwen2 import Qwen2Model
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix
from vllm.sequence import IntermediateTensors

from omni_jobs.engines.omni_speech import TALKER_EXTRA_ARG, TalkerConditioning


class Qwen2_5OmniTalkerForCodes(nn.Module, SupportsMRoPE):
    """The talker (Qwen2-style decoder over codec embeddings of the thinker's width, projected to its own),
    writing codec codes; the codec start code is never sampled (transformers suppresses it too)."""

    hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={"talker.": "", "thinker.": None, "token2wav.": None})

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: Any = vllm_config.model_config.hf_config
        if getattr(config, "model_type", None) != "qwen2_5_omni_talker":
            raise ValueError("Qwen2_5OmniTalkerForCodes needs the talker's own config (hf_config_path: "
                             f"omni_speech.talker_config_dir), got model_type {getattr(config, 'model_type', None)!r}")
        heads, hidden = int(config.num_attention_heads), int(config.hidden_size)
        head_dim = getattr(config, "head_dim", None)
        if head_dim is not None and int(head_dim) * heads != hidden:
            raise ValueError(f"the talker's head_dim {head_dim} x {heads} heads is not its hidden_size {hidden}; "
                             "vLLM's Qwen2 layers take head_dim = hidden_size / heads (the real checkpoints do)")
        self.config = config
        self.model = Qwen2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        # the codec embeddings are as wide as the thinker's states they are added to, not the talker's hidden size
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.embedding_size,
                                                         prefix=maybe_prefix(prefix, "model.embed_tokens"))
        self.thinker_to_talker_proj = ReplicatedLinear(config.embedding_size, hidden, bias=True,
                                                       prefix=maybe_prefix(prefix, "thinker_to_talker_proj"))
        self.codec_head = ParallelLMHead(config.vocab_size, hidden, prefix=maybe_prefix(prefix, "codec_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.codec_bos = int(config.tts_codec_start_token_id)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self._runner: Any = None

    def bind_runner(self, runner: object) -> None:
        """The model runner whose batch this model reads each step (which request each token is)."""
        for attribute in ("input_batch", "requests", "query_start_loc"):
            if not hasattr(runner, attribute):
                raise RuntimeError(f"vLLM's model runner {type(runner).__name__} has no {attribute!r}: the talker "
                                   "reads per-request rows from it (written against vLLM 0.32)")
        self._runner = runner

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Codec embeddings, in the thinker's width (before ``thinker_to_talker_proj``)."""
        embeds: torch.Tensor = self.model.embed_tokens(input_ids)
        return embeds

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[torch.Tensor, int]:
        """Text positions (row 0 is then each token's sequence index, which ``_rows`` relies on); a request whose
        conditioning holds its own M-RoPE positions (media in the thinker's prompt) gets those in ``forward``."""
        n = len(input_tokens)
        return torch.arange(n).view(1, -1).expand(3, -1).clone(), 0

    def _rows(self, n: int, positions: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For the ``n`` scheduled tokens: each one's thinker row [n, E], whether it takes its codec embedding [n],
        and its rope positions [3, n]. Tokens of no request (vLLM's warm-up and profiling runs, padding) get zeros."""
        width = int(self.config.embedding_size)
        rows = torch.zeros(n, width, dtype=dtype, device=positions.device)
        codec = torch.ones(n, dtype=torch.bool, device=positions.device)
        pos = positions if positions.ndim == 2 else positions.view(1, -1).expand(3, -1)
        runner = self._runner
        if runner is None:
            return rows, codec, pos
        batch = runner.input_batch
        num_reqs = int(batch.num_reqs)
        starts = runner.query_start_loc.np[: num_reqs + 1]
        if num_reqs == 0 or int(starts[-1]) > n:
            return rows, codec, pos
        pos = pos.clone()
        for r, req_id in enumerate(batch.req_ids[:num_reqs]):
            lo, hi = int(starts[r]), int(starts[r + 1])
            if hi <= lo:
                continue
            state = runner.requests.get(req_id)
            params = getattr(state, "sampling_params", None)
            extra = getattr(params, "extra_args", None) or {}
            cond = extra.get(TALKER_EXTRA_ARG)
            if cond is None:
                continue
            if not isinstance(cond, TalkerConditioning):
                raise TypeError(f"request {req_id!r}: extra_args[{TALKER_EXTRA_ARG!r}] is a "
                                f"{type(cond).__name__}, not a TalkerConditioning")
            index = pos[0, lo:hi].to(torch.long)  # sequence indices (get_mrope_input_positions: text positions)
            rows[lo:hi] = cond.rows.to(dtype)[index.clamp(max=cond.rows.shape[0] - 1)]
            codec[lo:hi] = index >= cond.codec_from
            if cond.positions is not None:
                given = cond.positions.shape[1]
                inside = index < given
                own = torch.where(inside, 0, index + cond.position_delta)
                pos[:, lo:hi] = torch.where(inside, cond.positions[:, index.clamp(max=given - 1)].to(pos.dtype),
                                            own.to(pos.dtype))
        return rows, codec, pos

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: object) -> torch.Tensor | IntermediateTensors:
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("the talker needs input_ids or inputs_embeds")
            inputs_embeds = self.embed_input_ids(input_ids)
        n = int(inputs_embeds.shape[0])
        rows, codec, pos = self._rows(n, positions, inputs_embeds.dtype)
        talker_in = torch.where(codec.unsqueeze(-1), inputs_embeds, torch.zeros_like(inputs_embeds)) + rows
        projected, _ = self.thinker_to_talker_proj(talker_in)
        hidden: torch.Tensor | IntermediateTensors = self.model(None, pos, intermediate_tensors,
                                                                inputs_embeds=projected)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits: torch.Tensor | None = self.logits_processor(self.codec_head, hidden_states)
        if logits is not None:
            logits[..., self.codec_bos] = float("-inf")  # never sampled: transformers' suppress_tokens
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        loaded: set[str] = loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
        return loaded
