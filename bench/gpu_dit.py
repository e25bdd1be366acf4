"""The DiT part of the benchmark on a GPU host (no Redis, Celery or vLLM there; diffusers travels as a wheel).

``python -m bench.gpu_dit [--jobs 64] [--batch 32]`` prints, per size, images/s of
sequential single calls (what a naive one-job-per-task worker does), of the pipeline on batches
(direct, the limit), and of N concurrent callers through omni_jobs.engines.batching's DiT batcher (what a
stage worker's threads do), with the ratios; and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omni_jobs.engines.batching import BatchPolicy, dit_batcher
from omni_jobs.engines.dit import DiTEngine, DiTRequest
from omni_jobs.local.tiny import build_bench_pixart, build_bench_pixart_small, build_tiny_pixart

SIZES = [("test model (tiny pixart)", "pixart", 32), ("small (bench-pixart-128)", "bench-pixart-128", 32),
         ("large (bench-pixart)", "bench-pixart", 64), ("large (bench-pixart)", "bench-pixart", 256)]


def _time(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(engine: DiTEngine, reqs: list[DiTRequest], batch: int, reps: int) -> tuple[float, float, float, Any]:
    """Median seconds of: single calls one after another, the pipeline on batches, N concurrent batcher callers."""

    def sequential() -> None:
        for r in reqs:
            engine.generate([r])

    def batched() -> None:
        for i in range(0, len(reqs), batch):
            engine.generate(reqs[i:i + batch])

    batcher = dit_batcher(engine, BatchPolicy(max_batch_size=batch, wait_ms=20))

    def through_batcher() -> None:
        with ThreadPoolExecutor(len(reqs)) as pool:
            list(pool.map(batcher.submit, reqs))

    return _time(sequential, reps), _time(batched, reps), _time(through_batcher, reps), batcher


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_dit")
    p.add_argument("--jobs", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("var/bench/results/gpu-dit.json"))
    args = p.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(tempfile.mkdtemp())
    models = {"pixart": build_tiny_pixart(root / "pixart"), "bench-pixart": build_bench_pixart(root / "bench-pixart"),
              "bench-pixart-128": build_bench_pixart_small(root / "bench-pixart-128")}
    rows: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": {}}
    for label, model, size in SIZES:
        engine = DiTEngine(str(models[model]), pipeline_class="PixArtSigmaPipeline", device=device)
        reqs = [DiTRequest(f"r{i}", prompt=f"a picture number {i} of a harbor", height=size, width=size,
                           num_inference_steps=args.steps, seed=i) for i in range(args.jobs)]
        engine.generate(reqs[:args.batch])  # warm-up at full batch (kernels, allocator)
        seq_s, batch_s, batcher_s, batcher = measure(engine, reqs, args.batch, args.reps)
        n = len(reqs)
        row = {"images_per_s": {"sequential": n / seq_s, "direct_batched": n / batch_s, "batcher": n / batcher_s},
               "batch_ratio_direct_over_sequential": seq_s / batch_s,
               "batcher_over_direct": batch_s / batcher_s, "batcher_over_sequential": seq_s / batcher_s,
               "batch_sizes_seen": sorted(set(batcher.batches))}
        rows["rows"][f"{label} {size}px"] = row
        print(f"{label} {size}px: seq {n / seq_s:.1f} img/s, batched {n / batch_s:.1f}, batcher {n / batcher_s:.1f}"
              f" | batched/seq {seq_s / batch_s:.2f}x, batcher/direct {batch_s / batcher_s:.2f}x", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, **rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
