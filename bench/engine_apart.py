"""The engine in the worker's process or in one of its own, beside the worker's own per-job work.

    python -m bench.engine_apart [--ms 20 5] [--jobs 256] [--reps 3] [--threads 64]

The GPU-shaped DiT (omni_jobs.engines.gpu_shaped) makes ``--jobs`` 256 px images in three arms that take
turns in every repetition:

* direct: ``generate`` in batches of 32, back to back, in this process and nothing else;
* in-process: ``--threads`` threads submit to the DiT batcher of the engine in this process, and each
  encodes its image as PNG once it has it, as a stage task does with its output (the worker's
  per-job work, holding the interpreter's lock for part of each encode);
* apart: the same threads and work, the engine in an engine process (omni_jobs.engines.engine_client),
  which batches what they submit itself.

It prints images/s and each arm over direct. This is the engine-side half of the benchmark's
``GPU-shaped DiT`` rows, without the API, Redis and Celery: what the engine loses to the worker's
threads, and what an engine process gets back.
"""

from __future__ import annotations

import argparse
import io
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from omni_jobs.engines.batching import BatchPolicy
from omni_jobs.engines.dit import DiTRequest
from omni_jobs.engines.engine_client import DiTEngineProcess
from omni_jobs.engines.gpu_shaped import GpuShapedDiT
from omni_jobs.engines.pool import DiTKind
from omni_jobs.engines.stage_exec import dit_submitter

SIZE = 256
BATCH = 32


def requests(n: int, rep: int) -> list[DiTRequest]:
    return [DiTRequest(f"r{rep}-{i}", prompt=f"image {rep} {i}", height=SIZE, width=SIZE, seed=i,
                       num_inference_steps=20) for i in range(n)]


def direct(engine: GpuShapedDiT, batch: list[DiTRequest]) -> float:
    started = time.perf_counter()
    for k in range(0, len(batch), BATCH):
        engine.generate(batch[k:k + BATCH])
    return time.perf_counter() - started


def through_batcher(engine: DiTKind, batch: list[DiTRequest], *, threads: int) -> float:
    """``threads`` workers take the requests in order; each submits one, encodes its PNG, takes the next."""
    batcher = dit_submitter(engine, BatchPolicy(max_batch_size=BATCH, wait_ms=20))
    left = list(reversed(batch))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not left:
                    return
                request = left.pop()
            image = batcher.submit(request).image
            assert image is not None
            image.save(io.BytesIO(), format="PNG")

    started = time.perf_counter()
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine_apart", description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", type=float, nargs="+", default=[20.0, 5.0], help="the engine's milliseconds an image")
    p.add_argument("--jobs", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2 * BATCH, help="the worker's task threads (stage_max_in_flight)")
    args = p.parse_args(argv)
    for ms in args.ms:
        local = GpuShapedDiT(ms_per_image=ms)
        apart = DiTEngineProcess("gpu-shaped", {"kind": "gpu-shaped", "ms_per_image": ms}, device="cpu")
        try:
            arms: dict[str, Callable[[list[DiTRequest]], float]] = {
                "direct": partial(direct, local),
                "in-process": partial(through_batcher, local, threads=args.threads),
                "apart": partial(through_batcher, apart, threads=args.threads),
            }
            for arm in arms.values():  # warm: the noise tile, the batchers' fits
                arm(requests(BATCH * 2, -1))
            times: dict[str, list[float]] = {name: [] for name in arms}
            for rep in range(args.reps):
                for name, arm in arms.items():
                    times[name].append(arm(requests(args.jobs, rep)))
            report(ms, args.jobs, times)
        finally:
            apart.close()


def report(ms: float, jobs: int, times: dict[str, list[float]]) -> None:
    d = times["direct"]
    print(f"GPU-shaped DiT {ms:g} ms, {jobs} images x {len(d)} reps")
    for name, ts in times.items():
        ratios = [a / b for a, b in zip(d, ts, strict=True)]
        row: dict[str, Any] = {"img/s": round(jobs / statistics.median(ts), 1),
                               "over direct (median)": round(statistics.median(ratios), 3),
                               "per rep": [round(r, 3) for r in ratios]}
        print(f"  {name:<11} {row}")


if __name__ == "__main__":
    main()
