"""Qwen2.5-Omni's code2wav in a process of its own (omni_jobs.engines.engine_client.Code2WavProcess): on the tiny
checkpoint it renders the clips the in-process engine renders, a stream through its batcher joins to the same audio,
a member that fails fails alone, and a SIGKILLed process is replaced with the request answered."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from omni_jobs.engines.batching import BatchPolicy
from omni_jobs.engines.code2wav import Code2Wav, Code2WavFront, Code2WavRequest, code2wav_batcher
from omni_jobs.engines.engine_client import Code2WavProcess
from omni_jobs.engines.pool import Code2WavKind, EnginePool, EngineProcessChoice
from omni_jobs.engines.torchvision_free import install
from omni_jobs.media.payloads import AudioClip
from tests.conftest import MODELS_DIR

pytest.importorskip("transformers")

MODEL = "tiny:qwen2.5-omni"
ATOL = 1e-4
"""The process and this one run the same float32 kernels; only a batch's company may differ (measured: 2.6e-7)."""
POLICY = BatchPolicy(max_batch_size=8, wait_ms=5.0)


def pool(engine_process: EngineProcessChoice) -> EnginePool:
    return EnginePool(MODELS_DIR, kv_cache_bytes=2**20, max_model_len=64, device="cpu", engine_process=engine_process)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Code2WavProcess, Code2Wav]]:
    """Both engines, loaded at once (the process's load beside this one's): each takes ~10 s on 2 cores. The
    process takes no host-wide engine turns: another suite's engines on this host would hold it up."""
    install()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMNI_ENGINE_TURNS", "off")  # read by the engine process (and its restarts) at start
        yield from _loaded()


def _loaded() -> Iterator[tuple[Code2WavProcess, Code2Wav]]:
    apart_pool, inside_pool = pool("on"), pool("off")
    inside_pool._resolve(MODEL)
    loaded: list[Code2WavKind] = []
    loading = threading.Thread(target=lambda: loaded.append(inside_pool.code2wav(MODEL, {})))
    loading.start()
    apart = apart_pool.code2wav(MODEL, {})
    loading.join()
    assert isinstance(apart, Code2WavProcess) and isinstance(loaded[0], Code2Wav)
    yield apart, loaded[0]
    apart_pool.close()


@pytest.fixture(scope="module")
def apart(engines: tuple[Code2WavProcess, Code2Wav]) -> Code2WavProcess:
    return engines[0]


@pytest.fixture(scope="module")
def inside(engines: tuple[Code2WavProcess, Code2Wav]) -> Code2Wav:
    return engines[1]


def codes(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def close(a: AudioClip, b: AudioClip) -> bool:
    return a.sample_rate == b.sample_rate and a.samples.shape == b.samples.shape and \
        bool(np.allclose(a.samples, b.samples, atol=ATOL))


def test_the_process_renders_what_the_engine_renders_in_process(apart: Code2WavProcess, inside: Code2Wav) -> None:
    for fact in ("block_codes", "num_codes", "samples_per_code", "sample_rate", "max_codes"):
        assert getattr(apart, fact) == getattr(inside, fact), fact
    requests = [Code2WavRequest("a", codes(24, 1), "Ethan"), Code2WavRequest("b", codes(24, 2), "Ethan", seed=3),
                Code2WavRequest("c", codes(12, 3), "Chelsie", offset=12), Code2WavRequest("empty", (), "Ethan")]
    got = apart.render(requests)
    # the in-process engine renders few: in pytest's process on a busy host a render took up to ~10x as long
    want = dict(zip("ace", inside.render([requests[0], requests[2], requests[3]]), strict=True))
    assert [c.samples.shape for c in got] == [(1, 24 * 480), (1, 24 * 480), (1, 12 * 480), (1, 0)]
    assert close(got[0], want["a"]) and close(got[2], want["c"]) and close(got[3], want["e"])
    assert all(g.samples.dtype == np.float32 for g in got)
    # submitted from several threads at once, through the stage's batcher: one batch a length and voice
    answers: dict[str, AudioClip] = {}

    def submit(r: Code2WavRequest) -> None:
        answers[r.request_id] = code2wav_batcher(apart, POLICY).submit(r)

    threads = [threading.Thread(target=submit, args=(r,)) for r in requests[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert close(answers["a"], got[0]) and close(answers["b"], got[1])


def test_a_member_that_fails_fails_alone_and_keeps_its_class(apart: Code2WavProcess) -> None:
    good = Code2WavRequest("good", codes(12, 5), "Ethan")
    alone = apart.render([good])[0]
    failed: list[BaseException] = []

    def bad() -> None:
        try:
            code2wav_batcher(apart, POLICY).submit(Code2WavRequest("bad", codes(12, 6), "Nobody"))
        except ValueError as exc:
            failed.append(exc)

    thread = threading.Thread(target=bad)
    thread.start()
    clip = code2wav_batcher(apart, POLICY).submit(good)
    thread.join()
    assert close(clip, alone)
    assert len(failed) == 1 and "Nobody" in str(failed[0])
    with pytest.raises(ValueError, match="outside token2wav's codebook"):
        apart.render([Code2WavRequest("control", (1, 2, 100_000), "Ethan")])


def stream_through(engine: Code2WavFront, clip_codes: tuple[int, ...]) -> np.ndarray:
    stream = engine.stream("Ethan", seed=7, render=code2wav_batcher(engine, POLICY).submit)
    pieces = []
    for i in range(0, len(clip_codes), 5):  # the talker's codes, a few a step
        got = stream.push(clip_codes[i : i + 5])
        if got is not None:
            pieces.append(got.samples[0])
    pieces.append(stream.finish().samples[0])
    return np.concatenate(pieces)


def test_a_stream_through_the_process_joins_to_the_same_audio(apart: Code2WavProcess, inside: Code2Wav) -> None:
    clip_codes = codes(50, 8)
    joined, alone = stream_through(apart, clip_codes), stream_through(inside, clip_codes)
    assert joined.shape == alone.shape == (50 * 480,)
    assert np.allclose(joined, alone, atol=ATOL)


def test_a_killed_process_is_replaced_and_the_request_it_ran_is_answered(apart: Code2WavProcess) -> None:
    request = Code2WavRequest("long", codes(48, 9), "Chelsie")  # ~0.5 s to render on 2 cores
    want = apart.render([request])[0]  # the same as in-process: the first test
    first, batches = apart.pid, len(apart.batches)
    answer: list[AudioClip] = []
    thread = threading.Thread(target=lambda: answer.append(apart.render([request])[0]))
    thread.start()
    deadline = time.monotonic() + 30
    while len(apart.batches) == batches and time.monotonic() < deadline:  # its batch has started
        time.sleep(0.005)
    os.kill(first, signal.SIGKILL)
    thread.join(timeout=120)
    assert answer and close(answer[0], want)
    assert apart.pid != first and apart.process.restarts == 1
