"""A DiT engine in a process of its own (omni_jobs.engines.engine_client): the tiny PixArt, run there and in
this process, gives the same images, latents, progress and previews; cancel, per-member failures and a
killed engine process behave as the worker needs."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_jobs.engines.batching import BatchPolicy
from omni_jobs.engines.dit import DiTEngine, DiTOutput, DiTRequest
from omni_jobs.engines.engine_client import DiTEngineProcess, EngineCrashed
from omni_jobs.engines.pool import EnginePool
from omni_jobs.media.previews import LatentPreview
from tests.conftest import MODELS_DIR

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def apart() -> Iterator[DiTEngineProcess]:
    pool = EnginePool(MODELS_DIR, kv_cache_bytes=2**20, max_model_len=64, device="cpu", engine_process="on")
    engine = pool.dit("tiny:pixart", {})
    assert isinstance(engine, DiTEngineProcess)
    yield engine
    pool.close()


@pytest.fixture(scope="module")
def shaped() -> Iterator[DiTEngineProcess]:
    """The GPU-shaped engine in its process: it starts again in a fraction of a second, so the crash tests
    kill it rather than the PixArt (whose process takes ~6 s to load again)."""
    engine = DiTEngineProcess("gpu-shaped", {"kind": "gpu-shaped", "ms_per_image": 10}, device="cpu")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def inside(engine_cache: EnginePool) -> DiTEngine:
    engine = engine_cache.dit("tiny:pixart", {})
    assert isinstance(engine, DiTEngine)
    return engine


def request(rid: str, seed: int, *, steps: int = 4, size: int = 64, **extra: Any) -> DiTRequest:
    return DiTRequest(rid, prompt=f"a lighthouse {seed}", height=size, width=size, seed=seed,
                      num_inference_steps=steps, **extra)


def pixels(out: DiTOutput) -> np.ndarray:
    assert out.image is not None
    return np.asarray(out.image, dtype=np.int16)


def test_the_engine_process_makes_what_the_engine_makes_in_process(apart: DiTEngineProcess,
                                                                     inside: DiTEngine) -> None:
    assert apart.pipeline_class == inside.pipeline_class == "PixArtSigmaPipeline"
    runs: dict[str, tuple[list[DiTOutput], list[tuple[int, int]], list[LatentPreview]]] = {}
    for name, engine in (("apart", apart), ("inside", inside)):
        steps: list[tuple[int, int]] = []
        previews: list[LatentPreview] = []
        batch = [request("a", 1), request("b", 2, want_latents=True),
                 request("c", 3, preview_every=2, on_preview=previews.append)]
        def on_step(done: int, total: int, steps: list[tuple[int, int]] = steps) -> None:
            steps.append((done, total))

        runs[name] = (engine.generate(batch, on_step=on_step), steps, previews)
    (out_a, steps_a, previews_a), (out_i, steps_i, previews_i) = runs["apart"], runs["inside"]
    assert steps_a == steps_i == [(k, 8) for k in range(1, 9)]  # two calls: latents wanted or not
    assert [o.request_id for o in out_a] == ["a", "b", "c"]
    for a, i in zip(out_a, out_i, strict=True):
        assert a.image is not None and a.image.size == (64, 64) and a.image.mode == "RGB"
        assert np.abs(pixels(a) - pixels(i)).max() <= 2
    assert isinstance(out_a[1].latents, torch.Tensor) and out_i[1].latents is not None
    assert out_a[1].latents.dtype == out_i[1].latents.dtype and out_a[1].latents.shape == out_i[1].latents.shape
    assert torch.allclose(out_a[1].latents, out_i[1].latents, atol=1e-3)
    assert [(p.step, p.total, p.width, p.height) for p in previews_a] == [(2, 4, 64, 64)]
    assert [(p.step, p.total) for p in previews_i] == [(2, 4)]
    assert np.allclose(previews_a[0].latents, previews_i[0].latents, atol=1e-3)
    assert np.array_equal(previews_a[0].projection.weight, previews_i[0].projection.weight)
    assert previews_a[0].image().size == previews_i[0].image().size


def test_what_the_engine_refuses_keeps_its_class_and_message(apart: DiTEngineProcess) -> None:
    with pytest.raises(ValueError, match="asks for a video, but PixArtSigmaPipeline cannot make it"):
        apart.generate([request("v", 1, num_frames=5)])
    with pytest.raises(ValueError, match="text-to-audio"):
        apart.check_task("text-to-audio")
    apart.check_task("text-to-image")  # asked once, remembered
    assert len(apart.generate([request("after", 1, steps=1)])) == 1  # the process serves on


def test_a_call_whose_members_all_stop_stops_within_a_step_or_two(apart: DiTEngineProcess) -> None:
    seen: list[int] = []

    def cancel_at_2(done: int, total: int) -> None:
        seen.append(done)
        if done == 2:
            raise KeyboardInterrupt("canceled")  # any exception: the batcher's is _AllMembersStopped

    with pytest.raises(KeyboardInterrupt, match="canceled"):
        apart.generate([request("long", 1, steps=40)], on_step=cancel_at_2)
    assert seen[:2] == [1, 2] and len(seen) <= 4  # the Stop reached the process at its next step or the one after
    assert len(apart.generate([request("next", 2, steps=1)])) == 1


def test_a_member_that_fails_fails_alone_in_its_batch(apart: DiTEngineProcess) -> None:
    batcher = apart.batcher(BatchPolicy(max_batch_size=4, wait_ms=200))
    results: dict[str, object] = {}

    def run(rid: str, progress: Callable[[int, int], None] | None) -> None:
        try:
            results[rid] = batcher.submit(request(rid, 7, steps=3), progress)
        except BaseException as exc:  # noqa: BLE001 - what this member got
            results[rid] = exc

    def canceled(done: int, total: int) -> None:
        raise LookupError("member canceled")

    threads = [threading.Thread(target=run, args=("kept", None)), threading.Thread(target=run, args=("gone", canceled))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert isinstance(results["kept"], DiTOutput) and results["kept"].image is not None
    assert isinstance(results["gone"], LookupError)
    assert 2 in batcher.batches  # one call for both


def kill_at_first_step(engine: DiTEngineProcess, times: int) -> Callable[[int, int], None]:
    """An on_step that SIGKILLs the engine process at the first step of each of its first ``times`` attempts."""
    killed: list[int] = []

    def on_step(done: int, total: int) -> None:
        if done == 1 and len(killed) < times and engine.pid not in killed:
            killed.append(engine.pid)
            os.kill(engine.pid, signal.SIGKILL)

    return on_step


def test_a_killed_engine_process_is_replaced_and_its_call_runs_again(shaped: DiTEngineProcess) -> None:
    batch = [request("k1", 11), request("k2", 12, want_latents=True)]
    clean = shaped.generate(batch)
    first, restarts = shaped.pid, shaped.process.restarts
    again = shaped.generate(batch, on_step=kill_at_first_step(shaped, times=1))
    assert shaped.pid != first and shaped.process.restarts == restarts + 1
    for a, b in zip(clean, again, strict=True):
        assert np.array_equal(pixels(a), pixels(b))
    assert again[1].latents is not None and clean[1].latents is not None
    assert torch.equal(again[1].latents, clean[1].latents)
    assert not list(Path("/dev/shm").glob(f"omni-eng-{first}-*"))


def test_a_call_that_crashes_a_fresh_process_too_fails_and_the_next_call_runs(shaped: DiTEngineProcess) -> None:
    restarts = shaped.process.restarts
    with pytest.raises(EngineCrashed, match="twice on the same call"):
        shaped.generate([request("poison", 1)], on_step=kill_at_first_step(shaped, times=2))
    assert len(shaped.generate([request("healthy", 2, steps=1)])) == 1
    assert shaped.process.restarts == restarts + 2  # the retry's process, and one for the calls after


def test_a_model_that_cannot_load_fails_where_it_is_asked_for(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no-such-model"):
        DiTEngineProcess(str(tmp_path / "no-such-model"), {}, device="cpu")


def test_submitted_requests_run_again_on_a_fresh_process_when_theirs_is_killed(shaped: DiTEngineProcess) -> None:
    batcher = shaped.batcher(BatchPolicy(max_batch_size=8, wait_ms=300))
    batch = [request(f"s{i}", 20 + i, steps=3) for i in range(4)]
    clean = shaped.generate(batch)
    first, restarts = shaped.pid, shaped.process.restarts
    killer = kill_at_first_step(shaped, times=1)
    results: dict[str, object] = {}

    def run(r: DiTRequest) -> None:
        results[r.request_id] = batcher.submit(r, killer)

    threads = [threading.Thread(target=run, args=(r,)) for r in batch]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert shaped.pid != first and shaped.process.restarts == restarts + 1
    for want in clean:
        got = results[want.request_id]
        assert isinstance(got, DiTOutput) and np.array_equal(pixels(got), pixels(want))
    assert batcher.batches[-1] == 4  # sent again together, batched again together
