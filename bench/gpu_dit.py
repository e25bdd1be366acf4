"""The DiT path on a GPU host: the engine alone, the batcher, and the whole system.

``python -m bench.gpu_dit [--sizes 256 512] [--jobs 64] [--batch 32] [--reps 3]`` builds the
benchmark's DiT (``--model``, random weights, omni_jobs.local.tiny), and for each image size runs
the same N images, seeded alike, four ways, taking turns in every repetition:

* sequential: one engine call per image (what a one-job-per-task worker does);
* direct: the pipeline on batches of ``--batch`` in this process (the limit);
* batcher: N concurrent callers through omni_jobs.engines.batching's DiT batcher, in this process
  (what a stage worker's threads do, without Redis or Celery);
* system: N jobs POSTed to the real API of an EmbeddedSystem (Redis, a Celery DiT worker on the
  GPU, the results worker), which writes every image as a PNG artifact.

It prints images/s per arm and the paired ratios batcher/direct and system/direct (medians of the
per-repetition ratios), and writes JSON to --out. ``--no-system`` skips the system (no redis-server
needed). The AR engine (vLLM) is neither needed nor loaded: the system runs no AR worker.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.run import ROOT, Arm, Bench, _pct, as_engine_process, generate_images, prompts
from omni_jobs.engines.batching import BatchPolicy, dit_batcher
from omni_jobs.engines.dit import DiTEngine, DiTRequest
from omni_jobs.engines.openmp import release_thread_team
from omni_jobs.jobs.models import Job
from omni_jobs.local.devservices import exit_on_sigterm
from omni_jobs.local.tiny import resolve_model

SYSTEM_QUEUES = {"dit": "threads", "results": "solo", "webhooks": "threads"}
"""`omni-jobs up`'s workers less the AR one: the DiT path alone."""


def pipeline_name(size: int) -> str:
    return f"g-image-{size}"


def pipelines(model: str, sizes: list[int], batch: int, steps: int, dtype: str) -> list[dict[str, Any]]:
    """One text-to-image pipeline per size, on the system's DiT queue, batched as the direct arm."""
    return [{"name": pipeline_name(size), "inputs": {"prompt": {"type": "text", "max_length": 2000}},
             "stages": [{"id": "dit", "engine": "dit", "model": model, "queue": "dit", "inputs": {"prompt": "input.prompt"},
                         "engine_args": {"pipeline_class": "PixArtSigmaPipeline", "torch_dtype": dtype},
                         "batching": {"max_batch_size": batch, "wait_ms": 20},
                         "defaults": {"height": size, "width": size, "num_inference_steps": steps, "seed": 0}}],
             "outputs": [{"name": "image", "from": "dit.image"}]} for size in sizes]


def waits(jobs: list[Job]) -> dict[str, float]:
    """Where the system's jobs waited, from their own records (ms): created to the stage's start (the
    API, the relay, the broker, the worker's receipt and lease), p50 and max; and the stage's end to
    the job's completion (the results step, inline or not), p50 and max."""
    def ms(values: list[float], p: int) -> float:
        value = _pct(values, p)
        return float("nan") if value is None else 1000 * value

    to_start = [j.stages[0].started_at - j.created_at for j in jobs if j.stages[0].started_at]
    to_done = [j.completed_at - j.stages[-1].finished_at for j in jobs if j.completed_at and j.stages[-1].finished_at]
    return {"to_start_p50": ms(to_start, 50), "to_start_max": ms(to_start, 100),
            "after_stage_p50": ms(to_done, 50), "after_stage_max": ms(to_done, 100)}


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _on_this_thread(fn: Callable[[], object]) -> float:
    """Time ``fn`` run on this (the main) thread, then hand back this thread's OpenMP team, as a worker's
    idle batcher thread does (omni_jobs.engines.openmp): on the CPU, an idle team kept here made the
    batcher arm's every op barrier sleep (libgomp stops spinning once the teams outnumber the cores),
    and it ran at 0.80 of the direct arm; on a GPU it changes nothing."""
    took = _timed(fn)
    release_thread_team()
    return took


class GpuRow:
    """One image size: the engine's arms in this process; the system's through ``bench``."""

    def __init__(self, engine: DiTEngine, bench: Bench | None, size: int, args: argparse.Namespace) -> None:
        self.engine, self.bench, self.size, self.args = engine, bench, size, args
        self.batcher = dit_batcher(engine, BatchPolicy(max_batch_size=args.batch, wait_ms=20))
        self.images_per_s: dict[str, list[float]] = {}
        self.system = Arm()
        self.waits: list[dict[str, float]] = []
        """Per system repetition, where a job's time went before and after its engine call (ms)."""

    def requests(self, rep: int) -> list[DiTRequest]:
        """The repetition's images: the system arm's prompts (bench.run.prompts), image i seeded i."""
        return [DiTRequest(f"g{rep}-{i}", prompt=t, height=self.size, width=self.size,
                           num_inference_steps=self.args.steps, seed=i) for i, t in enumerate(prompts(self.args.jobs, rep))]

    def arms(self) -> dict[str, Callable[[int], float]]:
        """Arm name -> one repetition of it, returning its seconds."""
        batch = self.args.batch

        def images(rep: int, per_call: int) -> float:
            texts = prompts(self.args.jobs, rep)  # self.requests(rep)'s images, by direct engine calls
            return _on_this_thread(lambda: generate_images(self.engine, texts, self.size, self.args.steps, per_call))

        def sequential(rep: int) -> float:
            return images(rep, 1)

        def direct(rep: int) -> float:
            return images(rep, batch)

        def batcher(rep: int) -> float:
            reqs = self.requests(rep)
            with ThreadPoolExecutor(len(reqs)) as pool:
                return _timed(lambda: list(pool.map(self.batcher.submit, reqs)))

        def system(rep: int) -> float:
            assert self.bench is not None
            jobs = self.bench.system_rep(pipeline_name(self.size), rep, self.system)
            self.waits.append(waits(jobs))
            return self.args.jobs / self.system.jobs_per_s[-1]  # first job created to last completed

        out: dict[str, Callable[[int], float]] = {"direct": direct, "batcher": batcher}
        if self.args.sequential:
            out["sequential"] = sequential
        if self.bench is not None:
            out["system"] = system
        return out

    def run(self) -> dict[str, Any]:
        n, arms = self.args.jobs, self.arms()
        print(f"\n== {self.size}px: {n} images x {self.args.reps} reps, batch {self.args.batch}, "
              f"{self.args.steps} steps; arms {', '.join(arms)}", flush=True)
        warm = self.requests(998)[:self.args.batch]  # a full batch: the first call at a batch size allocates for it
        self.engine.generate(warm)
        with ThreadPoolExecutor(len(warm)) as pool:
            list(pool.map(self.batcher.submit, warm))
        if self.bench is not None:
            self.bench.run_jobs(pipeline_name(self.size), [f"warm up {r.prompt}" for r in warm])
        names = list(arms)
        for rep in range(self.args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]  # each arm goes first in turn
            for name in order:
                self.images_per_s.setdefault(name, []).append(n / arms[name](rep))
            print(f"  rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in self.images_per_s.items())
                  + " images/s", flush=True)
        return self.summary()

    def ratio(self, a: str, b: str) -> float | None:
        if a not in self.images_per_s or b not in self.images_per_s:
            return None
        return statistics.median(x / y for x, y in zip(self.images_per_s[a], self.images_per_s[b], strict=True))

    def summary(self) -> dict[str, Any]:
        n = self.args.jobs
        per_s = {k: statistics.median(v) for k, v in self.images_per_s.items()}
        out: dict[str, Any] = {
            "size": self.size, "images_per_s": per_s, "images_per_s_runs": self.images_per_s,
            "batch_over_sequential": self.ratio("direct", "sequential"),
            "batcher_over_direct": self.ratio("batcher", "direct"),
            "system_over_direct": self.ratio("system", "direct"),
            "batcher_batch_sizes": sorted(set(self.batcher.batches)),
        }
        if "system" in per_s:
            # the system's cost per image over the direct arm's: what API, Redis, Celery and results add
            out["system_extra_ms_per_image"] = 1000 * (1 / per_s["system"] - 1 / per_s["direct"])
            out["system"] = self.system.summary()
            out["system"]["batch_mean"] = self.system.batch_mean
            out["system"]["waits_ms"] = self.waits
        print(f"  {self.size}px: " + ", ".join(f"{k} {v:.1f}" for k, v in per_s.items()) + " images/s | "
              + ", ".join(f"{k} {v:.3f}" for k in ("batch_over_sequential", "batcher_over_direct", "system_over_direct")
                          if (v := out[k]) is not None), flush=True)
        if "system" in per_s:
            print(f"  system: {out['system_extra_ms_per_image']:.2f} ms more per image than direct; "
                  f"job p50 {out['system']['p50_s']:.2f} s, mean batch {self.system.batch_mean.get('dit')} "
                  f"({n} jobs)", flush=True)
            print("  system waits per rep (ms), created -> stage start p50/max, stage end -> job done p50/max: "
                  + "; ".join(f"{w['to_start_p50']:.0f}/{w['to_start_max']:.0f}, {w['after_stage_p50']:.0f}/"
                              f"{w['after_stage_max']:.0f}" for w in self.waits), flush=True)
        return out


def _write(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_dit", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512], help="image sizes, px (square)")
    p.add_argument("--model", default="tiny:bench-pixart", help="the DiT: a tiny: benchmark model or a local path")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--jobs", type=int, default=64, help="images per arm and repetition")
    p.add_argument("--batch", type=int, default=32, help="the engine's batch (direct arm and the DiT worker)")
    p.add_argument("--steps", type=int, default=20, help="denoising steps per image")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-sequential", dest="sequential", action="store_false", help="skip one-call-per-image")
    p.add_argument("--no-system", dest="system", action="store_false", help="the engine's arms only (no Redis)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "gpu-dit.json")
    args = p.parse_args(argv)
    # what bench.run's Bench reads
    args.ar_tokens, args.redis_durability, args.ab, args.engine_workers = 16, "auto", None, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    as_engine_process()
    exit_on_sigterm()  # a kill stops the system it started (the finally blocks, atexit)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    bench = Bench(args) if args.system else None
    results: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "rows": {},
                               "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                               "torch": torch.__version__}
    print(f"device: {results['device']} (torch {torch.__version__})", flush=True)
    started = time.time()
    try:
        if bench is not None:
            bench.start_system([args.model], pipelines(args.model, args.sizes, args.batch, args.steps, args.dtype),
                               SYSTEM_QUEUES)
        models_dir = (ROOT / "models").resolve()
        engine = DiTEngine(str(resolve_model(args.model, models_dir)), pipeline_class="PixArtSigmaPipeline",
                           torch_dtype=args.dtype, device=device)
        for size in args.sizes:
            results["rows"][f"{size}px"] = GpuRow(engine, bench, size, args).run()
            if bench is not None:
                results["rows"][f"{size}px"]["system"]["peak_rss_mib"] = {"dit": round(bench.worker_rss("dit"), 1)}
            _write(args.out, results)  # row by row: a run cut short keeps what it measured
        if device == "cuda":
            results["driver_gpu_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    finally:
        if bench is not None:
            bench.stop()
    results["wall_s"] = time.time() - started
    _write(args.out, results)
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
