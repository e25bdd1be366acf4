"""The autoregressive (AR) engine: a vLLM ``LLM`` that runs a whole batch of requests in one call.

vLLM batches internally, so callers hand it every pending request at once (one ``LLM.generate``);
that is where the throughput comes from. vLLM is imported lazily so that importing this module
(API process, tests of other parts) stays cheap.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SamplingOptions:
    """Per-request sampling; ``temperature == 0`` is greedy, ``seed`` makes sampling reproducible."""

    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class ARRequest:
    request_id: str
    prompt: str
    sampling: SamplingOptions


@dataclass(frozen=True)
class AROutput:
    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None


def _check_model_exists(model: str) -> None:
    """Fail early and clearly on a missing local model instead of deep inside vLLM.

    Strings that look like hub ids (``org/name``) pass through: vLLM resolves those itself.
    """
    if model.startswith("tiny:"):
        raise ValueError(f"{model!r} must be resolved to a path first (omni_jobs.tiny.resolve_model)")
    path = Path(model).expanduser()
    looks_local = path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"AR model directory {model!r} has no config.json")
    elif looks_local:
        raise FileNotFoundError(f"AR model path {model!r} does not exist")


class AREngine:
    """One vLLM engine in single-process mode (it must run inside Celery prefork children)."""

    def __init__(
        self,
        model: str,
        *,
        engine_args: Mapping[str, Any] | None = None,
        kv_cache_bytes: int = 256 * 2**20,
        max_model_len: int = 512,
    ) -> None:
        _check_model_exists(model)
        # Multiprocess mode cannot start inside a daemonic (prefork) process; must be set before LLM().
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        args: dict[str, Any] = {
            "dtype": "float32",
            "max_model_len": max_model_len,
            "max_num_seqs": 16,
            "enforce_eager": True,
            "kv_cache_memory_bytes": kv_cache_bytes,
            "seed": 0,
        }
        args.update(engine_args or {})
        self.model = model
        self._llm = LLM(model=model, **args)
        self._tokenizer = self._llm.get_tokenizer()
        self.max_model_len: int = int(self._llm.llm_engine.model_config.max_model_len)
        self._lock = threading.Lock()  # LLM is not thread-safe; one batch at a time

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids exactly as vLLM would make them (special tokens included)."""
        return list(self._tokenizer.encode(prompt))

    def _prompt_ids(self, request: ARRequest) -> list[int]:
        """Tokenize and check the length here: an over-long prompt must fail alone, not crash vLLM."""
        ids = self.tokenize(request.prompt)
        if not ids:
            raise ValueError(f"request {request.request_id!r}: the prompt tokenizes to no tokens")
        budget = self.max_model_len - request.sampling.max_tokens
        if len(ids) > budget:
            raise ValueError(
                f"request {request.request_id!r}: prompt is {len(ids)} tokens, but max_model_len "
                f"{self.max_model_len} minus max_tokens {request.sampling.max_tokens} leaves {budget}"
            )
        return ids

    def generate(self, requests: Sequence[ARRequest]) -> list[AROutput]:
        """Run all requests in ONE ``LLM.generate`` call; outputs come back in request order."""
        if not requests:
            return []
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=self._prompt_ids(r)) for r in requests]
        params = [
            SamplingParams(
                max_tokens=r.sampling.max_tokens,
                temperature=r.sampling.temperature,
                top_p=r.sampling.top_p,
                seed=r.sampling.seed,
            )
            for r in requests
        ]
        with self._lock:
            results = self._llm.generate(prompts, params, use_tqdm=False)
        if len(results) != len(requests):
            raise RuntimeError(f"vLLM returned {len(results)} outputs for {len(requests)} requests")
        return [_to_output(r, res) for r, res in zip(requests, results, strict=True)]


def _to_output(request: ARRequest, result: Any) -> AROutput:
    completion = result.outputs[0]
    return AROutput(
        request_id=request.request_id,
        text=completion.text,
        token_ids=list(completion.token_ids),
        prompt_token_ids=list(result.prompt_token_ids or []),
        finish_reason=completion.finish_reason,
    )
