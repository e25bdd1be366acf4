"""An AR engine whose core runs in vLLM's engine-core process (``apart``), on the tiny llama: its answers are the
in-process engine's, text streams and cancels still work, and a core killed mid-batch is started again with its
unfinished requests run again, nothing streamed twice. Unit tests of the decisions: tests/unit/test_ar_core.py."""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_jobs.engines.ar import AREngine, AROutput, ARRequest, SamplingOptions
from omni_jobs.pipelines.model_source import resolve_model

# Heavy (a vLLM core process started twice, 1.5-3.5 min): with the other heavy runs, ``-m chaos``.
pytestmark = [pytest.mark.chaos, pytest.mark.filterwarnings("ignore::UserWarning")]  # the resource tracker at exit

PROMPTS = ["The quick brown fox", "Hello, world! How are you today?", "A watercolor painting of a lighthouse"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("vllm")
    return resolve_model("tiny:llama", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def apart(model_path: str) -> Iterator[AREngine]:
    engine = AREngine(model_path, kv_cache_bytes=64 * 2**20, max_model_len=256, apart=True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def expected(model_path: str) -> dict[str, list[int]]:
    """Greedy continuations by transformers, the reference the in-process engine is held to (test_engines)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    found: dict[str, list[int]] = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=24, do_sample=False)
        found[prompt] = _until_eos(out[0, len(ids):].tolist(), eos)
    return found


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _greedy(prompt: str, rid: str, on_text: object = None) -> ARRequest:
    return ARRequest(rid, prompt, SamplingOptions(max_tokens=24), on_text=on_text)  # type: ignore[arg-type]


def test_the_core_runs_in_its_own_process_and_answers_as_transformers(
        apart: AREngine, expected: dict[str, list[int]]) -> None:
    pid = apart.core_pid()
    assert pid is not None and pid != os.getpid()
    assert Path(f"/proc/{pid}").exists()
    outputs = apart.generate([_greedy(p, f"r{i}") for i, p in enumerate(PROMPTS)])
    eos = apart._tokenizer.eos_token_id
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert _until_eos(out.token_ids, eos) == expected[prompt]
        assert out.prompt_token_ids == apart.tokenize(prompt)


def test_streamed_text_grows_to_the_answer_and_a_cancel_stops_its_request_alone(apart: AREngine) -> None:
    streamed: list[str] = []
    progress: dict[str, int] = {}

    def on_progress(rid: str, tokens: int, _max: int) -> None:
        progress[rid] = tokens
        if rid == "canceled" and tokens >= 3:
            raise LookupError("canceled by its job")

    requests = [_greedy(PROMPTS[0], "streamed", on_text=streamed.append), _greedy(PROMPTS[1], "canceled"),
                _greedy(PROMPTS[2], "plain")]
    results = apart.generate_each(requests, on_progress)
    assert isinstance(results[1], LookupError)
    assert progress["canceled"] == 3
    first, third = results[0], results[2]
    assert isinstance(first, AROutput) and isinstance(third, AROutput)
    assert len(streamed) == len(first.token_ids) and streamed[-1] == first.text  # one report a token
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(streamed))
    assert progress["plain"] == len(third.token_ids)


def test_a_core_killed_mid_batch_starts_again_and_its_requests_run_again_streaming_nothing_twice(
        apart: AREngine, expected: dict[str, list[int]]) -> None:
    killed: list[int] = []
    streamed: list[str] = []
    restarts = apart.restarts

    def on_progress(rid: str, tokens: int, _max: int) -> None:
        if rid == "r0" and tokens == 5 and not killed:
            pid = apart.core_pid()
            assert pid is not None
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)

    requests = [_greedy(PROMPTS[0], "r0", on_text=streamed.append), _greedy(PROMPTS[1], "r1")]
    results = apart.generate_each(requests, on_progress)
    assert killed and apart.restarts == restarts + 1
    assert apart.core_pid() not in (None, killed[0])
    assert Path(f"/proc/{apart.core_pid()}").exists()
    eos = apart._tokenizer.eos_token_id
    for prompt, result in zip(PROMPTS, results, strict=False):
        assert isinstance(result, AROutput), result
        assert _until_eos(result.token_ids, eos) == expected[prompt]
    first = results[0]
    assert isinstance(first, AROutput)
    assert len(streamed) == len(first.token_ids) and streamed[-1] == first.text  # its first 5 not streamed again
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(streamed))
    # and the fresh core serves the next call
    assert apart.generate([_greedy(PROMPTS[2], "after")])[0].token_ids[:3] == expected[PROMPTS[2]][:3]
