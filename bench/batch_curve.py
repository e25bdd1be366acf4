"""What a DiT batch's size buys: the engine's time per image at each batch size, and the fixed cost
per batch that a stage worker's batcher fits from such times (omni_jobs.engines.batching.fixed_cost_s).

    python -m bench.batch_curve [--rows small large] [--batches 1 4 8 16 32] [--reps 3]

Each row is one of the benchmark's DiT workloads (bench.run.WORKLOADS: its model and image size), or
``--model`` at ``--size``. The batch sizes take turns in every repetition, so that all of them share
the machine's drift, and each size's least time stands for it, as in the batcher's own fit.

How to read it. A batch costs ``a + b * n``. Where ``a`` is well above 0 a part batch wastes it, and
a batch that takes no newcomers once it runs waits for a burst still arriving
(``Batcher._wait_for_burst``). Where ``a`` is about 0 the engine is linear in the batch: a part
batch costs no engine time, the burst wait starts at once, and a larger ``max_batch_size`` buys no
throughput while each member waits for its whole batch. On a GPU host: ``--device cuda`` (the default where one is visible).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.run import ROOT, WORKLOADS, as_engine_process, generate_images, prompts
from omni_jobs.engines.batching import fixed_cost_s
from omni_jobs.engines.dit import DiTEngine
from omni_jobs.local.devservices import exit_on_sigterm
from omni_jobs.local.tiny import resolve_model

ROWS = {"small": "DiT 32px small", "large": "DiT 64px large"}
"""The short names of the benchmark's DiT rows (substrings of bench.run.WORKLOADS' names)."""


def row_target(name: str) -> tuple[str, int]:
    """(model, image size) of the benchmark row ``name`` (a key of ROWS, or a substring of a workload)."""
    wanted = ROWS.get(name, name)
    for w in WORKLOADS:
        if wanted in w.name and w.kind == "dit":
            return w.dit_model, w.size
    raise SystemExit(f"--rows: no DiT workload matches {name!r}; use one of {', '.join(ROWS)} "
                     f"or a part of: {', '.join(w.name for w in WORKLOADS if w.kind == 'dit')}")


def curve(engine: DiTEngine, size: int, batches: list[int], reps: int, steps: int) -> dict[int, list[float]]:
    """Seconds of each engine call, per batch size; the sizes take turns in every repetition."""
    times: dict[int, list[float]] = {n: [] for n in batches}
    for rep in range(reps):
        for n in batches:
            texts = prompts(n, 100 + rep)
            started = time.perf_counter()
            generate_images(engine, texts, size, steps, n)  # one engine call of n images
            times[n].append(time.perf_counter() - started)
    return times


def summary(times: dict[int, list[float]]) -> dict[str, Any]:
    """Each size's least time and time per image, and the fitted fixed cost per batch (s)."""
    least = {n: min(ts) for n, ts in times.items()}
    fixed = fixed_cost_s(list(least.items()))
    return {"least_s": least, "ms_per_image": {n: 1000 * t / n for n, t in least.items()}, "fixed_s": fixed}


def report(label: str, s: dict[str, Any]) -> str:
    largest = max(s["least_s"])
    lines = [f"{label}", "| batch | least s | ms per image | per image vs the largest batch |", "|---|---|---|---|"]
    for n in sorted(s["least_s"]):
        lines.append(f"| {n} | {s['least_s'][n]:.3f} | {s['ms_per_image'][n]:.1f} | "
                     f"{s['ms_per_image'][n] / s['ms_per_image'][largest]:.2f}x |")
    fixed = s["fixed_s"]
    if fixed is None:
        lines.append("fixed cost per batch: unknown (give two batch sizes or more)")
    else:
        share = fixed / s["least_s"][largest]
        lines.append(f"fixed cost per batch (fixed_cost_s): {1000 * fixed:.0f} ms, {share:.0%} of a batch of {largest}: "
                     + ("a part batch costs about nothing" if share < 0.02 else "what a part batch wastes"))
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.batch_curve", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", default=list(ROWS), help=f"benchmark DiT rows: {', '.join(ROWS)}")
    p.add_argument("--model", help="a DiT instead of the rows: a tiny: benchmark model or a local path (with --size)")
    p.add_argument("--size", type=int, default=64, help="the image size of --model, px (square)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32], help="batch sizes")
    p.add_argument("--steps", type=int, default=20, help="denoising steps per image")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every batch size")
    p.add_argument("--device", default=None, help="torch device (default: cuda where visible, else cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--out", type=Path, default=ROOT / "results" / "batch-curve.json")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.batches):
        p.error("--batches: every batch size must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    as_engine_process()  # the engine library settings and malloc of a stage worker
    exit_on_sigterm()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    targets = [(args.model, args.size)] if args.model else [row_target(r) for r in args.rows]
    batches = sorted(set(args.batches))
    results: dict[str, Any] = {"device": device, "steps": args.steps, "reps": args.reps, "rows": {}}
    models_dir = (ROOT / "models").resolve()
    for model, size in targets:
        engine = DiTEngine(str(resolve_model(model, models_dir)), pipeline_class="PixArtSigmaPipeline",
                           torch_dtype=args.dtype, device=device)
        generate_images(engine, prompts(1, 99), size, args.steps, 1)  # first-call costs out of the way
        s = summary(curve(engine, size, batches, args.reps, args.steps))
        label = f"{model} at {size}px on {device}, {args.steps} steps, least of {args.reps} reps"
        results["rows"][label] = s
        print(report(label, s) + "\n", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
