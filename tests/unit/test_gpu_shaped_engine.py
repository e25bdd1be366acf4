"""The benchmark's GPU-shaped DiT engine: real images, deterministic; its lock held for its share and
released for the rest; its engine_args checked by name; reachable only where a stage names it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_jobs.core.errors import PipelineSpecError
from omni_jobs.core.settings import Settings
from omni_jobs.engines.batching import BatchPolicy, dit_batcher
from omni_jobs.engines.dit import DiTRequest
from omni_jobs.engines.gpu_shaped import GpuShapedDiT
from omni_jobs.engines.pool import EnginePool
from omni_jobs.engines.stage_exec import load_stage_engine
from omni_jobs.media.previews import LatentPreview
from omni_jobs.omni import Omni
from omni_jobs.pipelines.catalogue import builtin_pipelines, parse_pipeline

FAST = {"ms_per_image": 1.0, "batch_size": 4}


def request(i: int, *, size: tuple[int, int] = (48, 64), steps: int = 4, seed: int | None = None,
            prompt: str | None = None, **extra: Any) -> DiTRequest:
    height, width = size
    return DiTRequest(f"r{i}", prompt=prompt if prompt is not None else f"prompt {i}", height=height, width=width,
                      num_inference_steps=steps, seed=i if seed is None else seed, **extra)


def pipeline(engine_args: dict[str, Any]) -> dict[str, Any]:
    return {"name": "shaped", "inputs": {"prompt": {"type": "text"}},
            "stages": [{"id": "dit", "engine": "dit", "model": "gpu-shaped", "inputs": {"prompt": "input.prompt"},
                        "engine_args": engine_args, "defaults": {"height": 64, "width": 64}}],
            "outputs": [{"name": "image", "from": "dit.image"}]}


def test_outputs_are_images_of_the_requested_size_in_order_and_the_same_for_the_same_seed_and_prompt() -> None:
    engine = GpuShapedDiT.from_args(FAST)
    requests = [request(i, size=(48, 64) if i % 2 else (40, 24)) for i in range(6)]  # two groups, one split in two
    outputs = engine.generate(requests)
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    assert [o.image.size if o.image else None for o in outputs] == [(r.width, r.height) for r in requests]
    assert all(o.image is not None and o.image.mode == "RGB" for o in outputs)
    again = engine.generate([request(3, size=(48, 64))])[0].image
    first = outputs[3].image
    assert first is not None and again is not None
    assert np.array_equal(np.asarray(first), np.asarray(again))
    other_seed = engine.generate([request(3, size=(48, 64), seed=4)])[0].image
    other_prompt = engine.generate([request(3, size=(48, 64), prompt="another")])[0].image
    assert other_seed is not None and other_prompt is not None
    assert not np.array_equal(np.asarray(first), np.asarray(other_seed))
    assert not np.array_equal(np.asarray(first), np.asarray(other_prompt))


def test_progress_previews_and_latents_come_as_the_diffusers_engine_gives_them() -> None:
    engine = GpuShapedDiT.from_args(FAST)
    previews: list[LatentPreview] = []
    steps_seen: list[tuple[int, int]] = []
    (out,) = engine.generate([request(0, size=(64, 32), steps=6, preview_every=2, on_preview=previews.append,
                                      want_latents=True)], on_step=lambda done, total: steps_seen.append((done, total)))
    assert steps_seen == [(i, 6) for i in range(1, 7)]
    assert [p.step for p in previews] == [2, 4]  # never at the last step
    assert previews[0].image().size == (32, 64) and previews[0].encode()[:2] == b"\xff\xd8"  # a JPEG
    assert out.latents is not None and tuple(out.latents.shape) == (4, 8, 4)


def test_its_defaults_are_the_h200s_profile() -> None:
    """20 ms an image in batches of 32, one image alone 6.25x its share of a batch, 6% on the CPU side."""
    engine = GpuShapedDiT()
    assert engine.batch_s(32) == pytest.approx(0.64)
    assert engine.batch_s(1) / (engine.batch_s(32) / 32) == pytest.approx(6.25, rel=0.02)
    assert engine.batch_s(40) == engine.batch_s(32)  # one device call holds at most batch_size
    assert engine.gil_share == 0.06


def test_a_request_it_cannot_make_and_a_task_it_does_not_run_are_refused() -> None:
    engine = GpuShapedDiT.from_args(FAST)
    with pytest.raises(ValueError, match="from text only"):
        engine.generate([DiTRequest("a", prompt="x", duration_s=1.0)])
    with pytest.raises(ValueError, match="text-to-image stages only"):
        engine.check_task("text-to-audio")


def test_a_batch_takes_its_time_with_the_lock_held_for_its_share_and_other_threads_run_meanwhile() -> None:
    """The engine thread's CPU time is its share of the batch (at least, by construction); the rest is a
    sleep, so a thread that only wants the interpreter's lock gets far more of it than the engine."""
    engine = GpuShapedDiT(ms_per_image=25, gil_share=0.1, batch_size=8, fixed_share=0.0)
    requests = [request(i, size=(16, 16), steps=10) for i in range(8)]
    engine.generate(requests[:1])  # warm
    stop = threading.Event()
    spun = [0.0]

    def spin() -> None:
        started = time.thread_time()
        n = 0
        while not stop.is_set():
            n += 1  # pure Python: holds the lock whenever it runs
        spun[0] = time.thread_time() - started

    other = threading.Thread(target=spin)
    other.start()
    wall, cpu = time.perf_counter(), time.thread_time()
    engine.generate(requests)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    stop.set()
    other.join()
    assert wall >= engine.batch_s(8) == pytest.approx(0.2)
    assert 0.1 * 0.2 <= cpu <= 0.1 * wall + 0.05
    assert spun[0] > 2 * cpu


@pytest.mark.parametrize(("args", "field"), [
    ({"ms_per_image": 0}, "engine_args.ms_per_image"),
    ({"gil_share": 1.5}, "engine_args.gil_share"),
    ({"batch_size": 0}, "engine_args.batch_size"),
    ({"fixed_share": 1}, "engine_args.fixed_share"),
    ({"pipeline_class": "PixArtSigmaPipeline"}, "engine_args.pipeline_class"),
])
def test_engine_args_are_checked_and_errors_name_the_field(args: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GpuShapedDiT.from_args(args)
    with pytest.raises(PipelineSpecError, match=field):
        parse_pipeline(pipeline({"kind": "gpu-shaped", **args}), source="test")


def test_a_mistyped_kind_is_refused_by_name() -> None:
    with pytest.raises(PipelineSpecError, match="engine_args.kind"):
        parse_pipeline(pipeline({"kind": "gpu_shaped"}), source="test")


def test_a_stage_that_names_it_gets_it_from_the_pool_and_shares_batches_through_the_dit_batcher(
        tmp_path: Path) -> None:
    spec = parse_pipeline(pipeline({"kind": "gpu-shaped", **FAST}), source="test")
    pool = EnginePool(tmp_path, kv_cache_bytes=0, max_model_len=0, device="cpu")
    engine = load_stage_engine(pool, spec.stages[0])
    assert isinstance(engine, GpuShapedDiT) and engine.batch_size == 4
    assert load_stage_engine(pool, spec.stages[0]) is engine
    assert not any(tmp_path.iterdir())  # nothing was built or loaded
    batcher = dit_batcher(engine, BatchPolicy(max_batch_size=4, wait_ms=200))
    results: list[Any] = [None] * 4

    def one(i: int) -> None:
        results[i] = batcher.submit(request(i, size=(16, 16)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.request_id for r in results] == ["r0", "r1", "r2", "r3"]
    assert batcher.batches == [4]


def test_no_built_in_pipeline_uses_it() -> None:
    for spec in builtin_pipelines():
        for stage in spec.stages:
            assert stage.engine_args.get("kind", "diffusers") == "diffusers", (spec.name, stage.id)


def test_a_job_on_it_runs_the_whole_stage_path_with_progress_previews_and_a_png_output(tmp_path: Path) -> None:
    """In process (Omni: the same stage runner as a worker's): the job's image stored and read back as a PNG."""
    spec = parse_pipeline(pipeline({"kind": "gpu-shaped", **FAST}), source="test")
    omni = Omni(spec, settings=Settings(models_dir=tmp_path / "models", artifacts_dir=tmp_path / "artifacts"))
    events: list[str] = []
    result = omni.generate({"prompt": "a lighthouse"}, {"dit": {"num_inference_steps": 6, "preview_every": 2}},
                           on_event=lambda e: events.append(str(e.type)))
    assert result["image"].image().size == (64, 64)
    assert events.count("output.preview") == 2 and "stage.progress" in events and events[-1] == "job.succeeded"
