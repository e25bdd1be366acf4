"""How a CPU engine's batch time reacts to other work on the machine, and to how its jobs are split.

``python -m bench.engine_noise`` loads the benchmark's small DiT (diffusers PixArt-Sigma, 32 px,
20 steps) in this process and times, with no Redis, Celery or API at all:

* one batch of 32 on a quiet machine, and with a foreign process that wakes every 10 ms and burns
  0.5 ms (5% of one core) or 2 ms (20%): what the system's own bookkeeping (API, Redis, the worker's
  Celery threads) costs the engine beyond its CPU, when torch's OpenMP threads use every core;
* 64 images split into batches the way the system may form them (32+32, 21+32+11, 3+32+29): whether
  the batch split matters.

The arms take turns; it prints medians. This is what the system/direct rows of ``python -m bench``
are made of on a small CPU machine (docs/decisions/another-process-wakeups.md).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from bench.run import DIT_SMALL, ROOT
from omni_jobs.engines.dit import DiTEngine, DiTRequest
from omni_jobs.local.devservices import exit_on_sigterm
from omni_jobs.local.tiny import ensure_tiny_model, resolve_model

NOISE = """import time
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < {busy}:
        pass
    time.sleep({idle})
"""


@contextmanager
def foreign_load(busy_s: float, period_s: float = 0.01) -> Iterator[None]:
    """A separate process busy ``busy_s`` out of every ``period_s`` (0: none)."""
    if busy_s <= 0:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", NOISE.format(busy=busy_s, idle=period_s - busy_s)])
    try:
        time.sleep(0.2)
        yield
    finally:
        proc.kill()
        proc.wait()


def run(engine: DiTEngine, split: Sequence[int], steps: int) -> float:
    """Seconds to make sum(split) images in batches of these sizes."""
    started = time.perf_counter()
    done = 0
    for n in split:
        engine.generate([DiTRequest(f"r{done + i}", prompt=f"a lantern over the harbor, number {done + i}",
                                    height=32, width=32, num_inference_steps=steps, seed=done + i) for i in range(n)])
        done += n
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # a kill stops what it started (the finally blocks, atexit)
    p = argparse.ArgumentParser(prog="python -m bench.engine_noise", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    models = (ROOT / "models").resolve()
    ensure_tiny_model(DIT_SMALL.removeprefix("tiny:"), models)
    engine = DiTEngine(resolve_model(DIT_SMALL, models), pipeline_class="PixArtSigmaPipeline")
    run(engine, [32], args.steps)  # warm up at the batch size
    loads = {"quiet": 0.0, "5% of a core": 0.0005, "20% of a core": 0.002}
    times: dict[str, list[float]] = {k: [] for k in loads}
    for _ in range(args.reps):
        for label, busy in loads.items():
            with foreign_load(busy):
                times[label].append(run(engine, [32], args.steps))
    quiet = statistics.median(times["quiet"])
    print(f"one batch of 32 ({args.steps} steps, 32 px), medians of {args.reps}:")
    for label, values in times.items():
        print(f"  {label:14} {statistics.median(values):5.2f} s  ({statistics.median(values) / quiet:.2f}x quiet)")
    splits = [(32, 32), (21, 32, 11), (3, 32, 29)]
    split_times: dict[tuple[int, ...], list[float]] = {s: [] for s in splits}
    for _ in range(args.reps):
        for s in splits:
            split_times[s].append(run(engine, s, args.steps))
    base = statistics.median(split_times[splits[0]])
    print("64 images, quiet machine:")
    for s, values in split_times.items():
        print(f"  batches {'+'.join(map(str, s)):10} {statistics.median(values):5.2f} s  "
              f"({statistics.median(values) / base:.2f}x of 32+32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
