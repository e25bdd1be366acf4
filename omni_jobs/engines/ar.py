"""The autoregressive (AR) engine: a vLLM ``LLM`` that runs a whole batch of requests in one call.

vLLM batches internally, so callers hand it every pending request at once (one ``LLM.generate``);
that is where the throughput comes from. vLLM is imported lazily so that importing this module
(API process, tests of other parts) stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_jobs.core import telemetry
from omni_jobs.core.json_types import JsonValue
from omni_jobs.engines import ar_core, ar_prompts, omni_speech, torchvision_free
from omni_jobs.engines.ar_prompts import Media
from omni_jobs.engines.engine_client import EngineCrashed
from omni_jobs.engines.gloo_device import one_gloo_device
from omni_jobs.engines.turns import engine_turn

if TYPE_CHECKING:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import PromptType
    from vllm.outputs import RequestOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingOptions:
    """Per-request sampling; ``temperature == 0`` is greedy, ``seed`` makes sampling reproducible."""

    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    """Only these tokens may be sampled (a speech model's language token, say)."""
    top_k: int = 0
    """Sample among the k likeliest tokens; 0: all of them."""
    repetition_penalty: float = 1.0
    """Above 1, tokens already in the prompt or the output are made less likely (transformers' and vLLM's rule)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the request besides the model's own end tokens (a talker's stop codes)."""
    detokenize: bool = True
    """False for token ids that are not text (a talker's codec codes): no text is made of them."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


TextSoFar = Callable[[str], None]
"""A request's detokenized text so far, at each engine step; may raise to stop that request."""
TokensSoFar = Callable[[Sequence[int]], None]
"""A request's token ids so far, at each engine step (a talker's codes, streamed); may raise to stop it."""


@dataclass(frozen=True)
class ARRequest:
    request_id: str
    prompt: str
    sampling: SamplingOptions
    on_text: TextSoFar | None = field(default=None, compare=False, repr=False)
    """Where the text goes as it is generated (streamed stages); the engine then steps the request."""
    media: Media = field(default_factory=dict, compare=False, repr=False)
    """Images, audio clips and videos by modality, handed to vLLM as ``multi_modal_data``."""
    chat: bool = False
    """Wrap the prompt (and the media's placeholders) in the model's chat template as one user turn."""
    system_prompt: str | None = None
    """With ``chat``: a system turn before it."""
    prompt_embeds: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """[tokens, hidden]: the prompt as embeddings (an upstream stage's), instead of ``prompt``'s text."""
    engine_prompt: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    """A prompt vLLM takes as it is, built by the engine itself (``transcription_prompts``)."""
    extra_args: Mapping[str, object] | None = field(default=None, compare=False, repr=False)
    """Per-request data for a model class of this project, as vLLM's ``SamplingParams.extra_args`` (the talker's
    thinker rows: omni_jobs.engines.omni_speech.TalkerConditioning)."""
    on_tokens: TokensSoFar | None = field(default=None, compare=False, repr=False)
    """Where the token ids go as they are generated (a talker's codes for streamed speech); the engine then steps."""


@dataclass(frozen=True)
class AROutput:
    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None


TokenProgress = Callable[[str, int, int], None]
"""(request id, tokens generated so far, max tokens); may raise to abort the batch."""


def _check_model_exists(model: str) -> None:
    """Fail early and clearly on a missing local model instead of deep inside vLLM.

    Strings that look like hub ids (``org/name``) pass through: vLLM resolves those itself.
    """
    if model.startswith("tiny:"):
        raise ValueError(f"{model!r} must be resolved to a path first (omni_jobs.pipelines.model_source.resolve_model)")
    path = Path(model).expanduser()
    looks_local = path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"AR model directory {model!r} has no config.json")
    elif looks_local:
        raise FileNotFoundError(f"AR model path {model!r} does not exist")


def build_llm(model: str, engine_args: Mapping[str, JsonValue] | None, *, kv_cache_bytes: int, max_model_len: int,
              apart: bool = False, **forced: object) -> LLM:
    """A vLLM ``LLM`` with our defaults, overridden by ``engine_args``, then ``forced``; its engine core in
    this process, or with ``apart`` in vLLM's engine-core process (omni_jobs.engines.ar_core).

    Shared by the generating engine and the pooling encoder so both start vLLM the same way.
    """
    _check_model_exists(model)
    torchvision_free.install()  # before vLLM imports a model file that imports an image processor
    from vllm import LLM

    args: dict[str, Any] = {  # vLLM's keyword arguments, each of its own type: from the YAML, unchecked here
        "dtype": "float32",
        "max_model_len": max_model_len,
        "max_num_seqs": 16,
        "enforce_eager": True,
        "kv_cache_memory_bytes": kv_cache_bytes,
        "seed": 0,
    }
    args.update(omni_speech.talker_engine_args(model, engine_args or {}))
    args.update(forced)
    with ar_core.core_layout(apart), one_gloo_device():  # its ~13 process groups on one gloo thread, not one each
        llm = LLM(model=model, **args)
    ar_core.watch_core(llm)
    omni_speech.bind_runners(llm)
    return llm


class AREngine:
    """One vLLM engine: its core in this process, or with ``apart`` in vLLM's engine-core process, which this
    engine starts again when it dies, running its unfinished requests again (omni_jobs.engines.ar_core)."""

    def __init__(
        self,
        model: str,
        *,
        engine_args: Mapping[str, JsonValue] | None = None,
        kv_cache_bytes: int = 256 * 2**20,
        max_model_len: int = 512,
        apart: bool = False,
    ) -> None:
        self.model = model
        self.apart = apart
        self._build = functools.partial(build_llm, model, engine_args, kv_cache_bytes=kv_cache_bytes,
                                        max_model_len=max_model_len, apart=apart)
        self._llm = self._build()
        self._tokenizer = self._llm.get_tokenizer()
        self.max_model_len: int = int(self._llm.llm_engine.model_config.max_model_len)
        self.architectures: tuple[str, ...] = tuple(self._llm.llm_engine.model_config.architectures or ())
        """vLLM's model class names (``Qwen2_5OmniTalkerForCodes`` for a talker: omni_speech)."""
        self.prompt_facts = ar_prompts.model_prompt_facts(self._llm)
        self._lock = threading.Lock()  # LLM is not thread-safe; one batch at a time
        self._counter = itertools.count()
        self.restarts = 0
        """How many times its engine-core process was started again after it died."""

    def core_pid(self) -> int | None:
        """The pid of the engine-core process (``apart``); None when the core runs in this process."""
        return ar_core.core_pid(self._llm)

    def close(self) -> None:
        """Stop its engine-core process (``apart``); an in-process core goes with the process."""
        if self.apart:
            ar_core.shut_down(self._llm)

    def _restart(self, cause: BaseException) -> None:
        """A fresh engine-core process in place of a dead one (the caller holds ``_lock``)."""
        dead = self.core_pid()
        ar_core.shut_down(self._llm)
        self.restarts += 1
        telemetry.engine_restart("ar")
        started = time.perf_counter()
        self._llm = self._build()
        log.warning("vLLM engine core of %s (pid %s) died (%s); restarted (%d so far) as pid %s in %.1f s",
                    self.model, dead, type(cause).__name__, self.restarts, self.core_pid(),
                    time.perf_counter() - started)

    @functools.cached_property
    def transcriber(self) -> ar_prompts.Transcriber:
        """This model's speech-to-text prompts (ValueError if it is no speech-to-text model)."""
        return ar_prompts.Transcriber(self._llm)

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

    def engine_prompt(self, request: ARRequest) -> PromptType:
        """What vLLM is handed for ``request`` (its text with the media's placeholders, tokens or embeddings)."""
        return self._engine_prompt(request)

    def _engine_prompt(self, request: ARRequest) -> PromptType:
        """What vLLM is handed for ``request``: token ids where the text alone is the prompt (its length
        checked here), the text with its media's placeholders and ``multi_modal_data`` (vLLM's processor
        expands them; it refuses an over-long result itself), or checked embeddings."""
        from vllm.inputs import EmbedsPrompt, TextPrompt, TokensPrompt

        if request.engine_prompt is not None:
            return dict(request.engine_prompt)  # type: ignore[return-value]  # built by this engine's model class
        budget = self.max_model_len - request.sampling.max_tokens
        if request.prompt_embeds is not None:
            if not self.prompt_facts.accepts_embeds:
                raise ValueError(f"request {request.request_id!r}: this engine takes no prompt_embeds; "
                                 "start it with engine_args enable_prompt_embeds: true")
            embeds = ar_prompts.check_embeds(request.prompt_embeds, self.prompt_facts.hidden_size, budget,
                                             request.request_id)
            return EmbedsPrompt(prompt_embeds=embeds)
        media = {m: items for m, items in request.media.items() if items}
        if not media and not request.chat:
            return TokensPrompt(prompt_token_ids=self._prompt_ids(request))
        ar_prompts.check_media(self.prompt_facts, media, self.model)
        placeholders = self.prompt_facts.placeholders(media)
        text = (ar_prompts.chat_prompt(self._llm, request.prompt, media, placeholders, request.system_prompt)
                if request.chat else ar_prompts.with_placeholders(request.prompt, placeholders))
        prompt = TextPrompt(prompt=text)
        if media:
            prompt["multi_modal_data"] = ar_prompts.multi_modal_data(media)
        return prompt

    def generate(self, requests: Sequence[ARRequest], on_progress: TokenProgress | None = None) -> list[AROutput]:
        """Run all requests as ONE engine batch; outputs come back in request order.

        Without ``on_progress`` (and no request's ``on_text``) this is a plain ``LLM.generate`` call.
        With it, the engine is stepped here so that each step reports (request id, tokens so far,
        max tokens) and each streamed request's text so far; if a callback raises, every request of
        the batch is aborted in vLLM and the exception propagates, so a canceled job stops at its
        next token and the engine stays usable.
        """
        if not requests:
            return []
        if self.apart:  # one path that survives its core process's death; the first failure raises
            outcomes = self.generate_each(requests, on_progress)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
            return [o for o in outcomes if isinstance(o, AROutput)]
        prompts = [self._engine_prompt(r) for r in requests]
        params = [self._sampling_params(r) for r in requests]
        from vllm.exceptions import VLLMClientError

        with self._lock:
            telemetry.batch("ar", len(requests))
            try:
                if on_progress is None and not any(r.on_text or r.on_tokens for r in requests):
                    results = self._llm.generate(prompts, params, use_tqdm=False)
                else:
                    results = self._step_batch(requests, prompts, params, on_progress)
            except VLLMClientError as exc:  # the request's fault (a prompt too long with its media): a ValueError
                raise ValueError(str(exc)) from exc
        if len(results) != len(requests):
            raise RuntimeError(f"vLLM returned {len(results)} outputs for {len(requests)} requests")
        return [_to_output(r, res) for r, res in zip(requests, results, strict=True)]

    def generate_each(self, requests: Sequence[ARRequest], on_progress: TokenProgress | None = None, *,
                      more: Callable[[int], Sequence[ARRequest]] | None = None,
                      on_result: Callable[[int, AROutput | BaseException], None] | None = None,
                      ) -> list[AROutput | BaseException]:
        """Run the requests as ONE engine batch, but fail each alone (the batcher's entry point).

        A request whose prompt is refused, or whose ``on_progress`` raises (its job was canceled),
        gets that exception in its slot and is aborted in vLLM; the others run on to the end.
        ``more(free_slots)`` is asked between engine steps for requests that arrived meanwhile:
        they join the running batch (continuous batching) and get slots after the first ones.
        ``on_result(slot, result)`` is called as soon as a request is done, so its caller need not
        wait for the whole batch.

        When the engine-core process dies (``apart``), a fresh one is started and the unfinished requests run
        again from their prompts; what they had already streamed is not streamed twice (``_Reported``). A
        request whose core dies twice gets EngineCrashed, as a DiT engine process's does.
        """
        from vllm.exceptions import VLLMClientError
        from vllm.outputs import RequestOutput
        from vllm.sampling_params import RequestOutputKind

        all_requests: list[ARRequest] = []
        results: list[AROutput | BaseException | None] = []
        reported: list[_Reported] = []
        ids: dict[str, int] = {}
        engine = self._llm.llm_engine
        turn = contextlib.nullcontext if self.apart else engine_turn  # a core apart has its own CPU time

        def settle(i: int, result: AROutput | BaseException) -> None:
            results[i] = result
            if on_result is not None:
                on_result(i, result)

        def add(i: int) -> None:
            r = all_requests[i]
            param = self._sampling_params(r)
            param.output_kind = RequestOutputKind.CUMULATIVE
            engine_id = f"omni-{next(self._counter)}"
            try:  # a prompt this model refuses (too long, media it does not take) fails its request alone
                engine.add_request(engine_id, self._engine_prompt(r), param)
            except (ValueError, TypeError, VLLMClientError) as exc:
                settle(i, exc if not isinstance(exc, VLLMClientError) else ValueError(str(exc)))
                return
            ids[engine_id] = i

        def admit(batch: Sequence[ARRequest]) -> None:
            for r in batch:
                all_requests.append(r)
                results.append(None)
                reported.append(_Reported())
                add(len(all_requests) - 1)

        def unsettled() -> list[int]:
            return [i for i in ids.values() if results[i] is None]

        def step() -> None:
            if more is not None:
                joining = more(len(unsettled()))
                if joining:
                    admit(joining)
                    telemetry.batch("ar", len(joining))
            with turn():  # on shared CPU cores, one engine step at a time (engines.turns)
                outputs = engine.step()
            for out in outputs:
                if not isinstance(out, RequestOutput):
                    raise TypeError(f"a generating vLLM engine answered {type(out).__name__}")
                i = ids.get(out.request_id, -1)
                if i < 0 or results[i] is not None:
                    continue
                r = all_requests[i]
                try:
                    reported[i].report(r, out, on_progress)
                except Exception as exc:  # noqa: BLE001 - this request alone stops
                    if not out.finished:
                        engine.abort_request([out.request_id])
                    settle(i, exc)
                    continue
                if out.finished:
                    settle(i, _to_output(r, out))

        with self._lock:
            crashed = 0
            try:
                admit(requests)
                telemetry.batch("ar", len(ids))
                while engine.has_unfinished_requests():
                    try:
                        step()
                    except Exception as exc:
                        if not (self.apart and ar_core.is_core_death(exc)):
                            raise
                        crashed += 1
                        again = unsettled()
                        ids.clear()
                        if crashed > 1:
                            for i in again:
                                settle(i, EngineCrashed(f"request {all_requests[i].request_id!r}: the engine core "
                                                            f"of {self.model} died twice under it"))
                            self._restart(exc)  # the engine stays usable for the next call
                            break
                        self._restart(exc)
                        engine = self._llm.llm_engine
                        for i in again:
                            reported[i].rerun()
                            add(i)
            except BaseException:
                unfinished = [e for e, i in ids.items() if results[i] is None]
                with contextlib.suppress(Exception) if self.apart else contextlib.nullcontext():
                    if unfinished:
                        engine.abort_request(unfinished)
                    while engine.has_unfinished_requests():
                        engine.step()
                raise
        missing = [all_requests[i].request_id for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"vLLM returned no output for {missing}")
        return [r for r in results if r is not None]

    @staticmethod
    def _sampling_params(request: ARRequest) -> SamplingParams:
        from vllm import SamplingParams

        sampling = request.sampling
        allowed = sampling.allowed_token_ids
        return SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            repetition_penalty=sampling.repetition_penalty,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            detokenize=sampling.detokenize,
            allowed_token_ids=list(allowed) if allowed is not None else None,
            extra_args=dict(request.extra_args) if request.extra_args is not None else None,
        )

    def _step_batch(self, requests: Sequence[ARRequest], prompts: list[PromptType], params: list[SamplingParams],
                    on_progress: TokenProgress | None) -> list[RequestOutput]:
        from vllm.outputs import RequestOutput
        from vllm.sampling_params import RequestOutputKind

        engine = self._llm.llm_engine
        ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            for prompt, param in zip(prompts, params, strict=True):
                param.output_kind = RequestOutputKind.CUMULATIVE
                ids.append(f"omni-{next(self._counter)}")  # outputs and aborts use this external id
                engine.add_request(ids[-1], prompt, param)
            by_id = dict(zip(ids, requests, strict=True))
            while engine.has_unfinished_requests():
                with engine_turn():
                    step = engine.step()
                for out in step:
                    if not isinstance(out, RequestOutput):  # this engine only generates
                        raise TypeError(f"a generating vLLM engine answered {type(out).__name__}")
                    request = by_id.get(out.request_id)
                    if request is None:
                        continue
                    if out.finished:
                        finished[out.request_id] = out
                    _report(request, out, on_progress)
            return [finished[i] for i in ids]
        except BaseException:
            unfinished = [i for i in ids if i not in finished]
            if unfinished:
                engine.abort_request(unfinished)
            while engine.has_unfinished_requests():  # drain what the abort left in flight
                engine.step()
            raise


class _Reported:
    """What a request has streamed so far, so that a run again after its core died streams only what is new.

    A run again from the prompt repeats what was streamed (greedy, or sampled with a seed) and is held back
    until it passes it; one that differs (sampled without a seed) fails its request rather than take text back."""

    def __init__(self) -> None:
        self.text = ""
        self.tokens = 0
        self.again = False

    def rerun(self) -> None:
        self.again = True

    def report(self, request: ARRequest, out: RequestOutput, on_progress: TokenProgress | None) -> None:
        completion = out.outputs[0]
        if self.again:
            text, tokens = completion.text, len(completion.token_ids)
            if not (text.startswith(self.text) or self.text.startswith(text)):
                raise RuntimeError(f"request {request.request_id!r}: its engine core died and the run again "
                                   "differs from what it had streamed; give the request a seed to make runs repeat")
            if tokens <= self.tokens and not out.finished:
                return  # still behind what was streamed
            self.again = False
        _report(request, out, on_progress)
        self.text, self.tokens = out.outputs[0].text, len(out.outputs[0].token_ids)


def _report(request: ARRequest, out: RequestOutput, on_progress: TokenProgress | None) -> None:
    """One step of one request: its text so far (streamed requests), then its token count."""
    completion = out.outputs[0]
    if request.on_text is not None:
        request.on_text(completion.text)
    if request.on_tokens is not None:
        request.on_tokens(completion.token_ids)
    if on_progress is not None:
        on_progress(request.request_id, len(completion.token_ids), request.sampling.max_tokens)


def _to_output(request: ARRequest, result: RequestOutput) -> AROutput:
    completion = result.outputs[0]
    return AROutput(
        request_id=request.request_id,
        text=completion.text,
        token_ids=list(completion.token_ids),
        prompt_token_ids=list(result.prompt_token_ids or []),
        finish_reason=completion.finish_reason,
    )
