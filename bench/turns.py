"""What sharing the CPU cores costs two engines: the multi-stage row's engine work, with nothing else.

    python -m bench.turns              # 3 repetitions of each arm
    python -m bench.turns --reps 5

The benchmark's AR engine (vLLM, 64 prompts x 16 tokens, stepped as a worker steps it) and its small
DiT (diffusers PixArt-Sigma, 64 images of 32 px in two batches of 32, 20 steps) each load in a
process of their own, with the engine library settings of a worker. No Redis, Celery or API. Arms:

* ``one after the other``: the AR work, then the DiT work (the shape of the direct arm of
  ``python -m bench``'s multi-stage row, which runs everything in one process);
* ``turns``: both at once, taking turns one engine step at a time (omni_jobs.engines.turns), as
  the AR and the DiT worker of ``omni-jobs up`` do on a CPU host;
* ``no turns``: both at once, each engine's OpenMP team on every core (``OMNI_ENGINE_TURNS=off``).

The arms take turns within each repetition; it prints each arm's wall time and CPU, and the
medians of the per-repetition ratios against one after the other. A ratio of 1.00 means that
running the two engines side by side costs nothing over running them in sequence: what the
multi-stage row loses against its direct arm beyond that is the system's own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.run import AR_MODEL, DIT_SMALL, ROOT, DirectProcess, _reply, ar_engine_args, generate_images, prompts
from omni_jobs.local.devservices import exit_on_sigterm

JOBS = 64
BATCH = 32
AR_TOKENS = 16  # the multi-stage row's AR stage
ARMS = ("one after the other", "turns", "no turns")


def serve(kind: str, models_dir: Path) -> None:
    """The child: load one engine, warm it up, then run the whole work once per request line
    ('SEED TURNS_FILE', the file '-' for no turns); answers its wall time and CPU."""
    from omni_jobs.engines import turns
    from omni_jobs.local.tiny import ensure_tiny_model, resolve_model

    model = AR_MODEL if kind == "ar" else DIT_SMALL
    ensure_tiny_model(model.removeprefix("tiny:"), models_dir)
    if kind == "ar":
        from omni_jobs.engines.ar import AREngine, ARRequest, SamplingOptions

        ar = AREngine(resolve_model(model, models_dir), engine_args=ar_engine_args(BATCH))

        def work(seed: int) -> None:  # stepped with a report per step, as a worker's batcher steps it
            ar.generate([ARRequest(f"r{seed}-{i}", p, SamplingOptions(max_tokens=AR_TOKENS))
                         for i, p in enumerate(prompts(JOBS, seed))], on_progress=lambda *_: None)
    else:
        from omni_jobs.engines.dit import DiTEngine

        dit = DiTEngine(resolve_model(model, models_dir), pipeline_class="PixArtSigmaPipeline")

        def work(seed: int) -> None:  # as the direct arm's DiT part
            generate_images(dit, prompts(JOBS, seed), 32, 20, BATCH)

    work(999)  # the first call at a batch size allocates for it
    _reply({"ready": True})
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        seed, path = line.split()
        turns.configure(None if path == "-" else Path(path))
        cpu0, t0 = time.process_time(), time.perf_counter()
        work(int(seed))
        _reply({"s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0})
    _reply({})


def one_rep(children: dict[str, DirectProcess], arm: str, seed: int, turns_file: Path) -> dict[str, float]:
    path = "-" if arm == "no turns" else str(turns_file)
    t0 = time.perf_counter()
    if arm == "one after the other":
        ar = children["ar"].ask(f"{seed} {path}")
        dit = children["dit"].ask(f"{seed} {path}")
    else:
        for child in children.values():
            child.send(f"{seed} {path}")
        ar, dit = children["ar"].answer(), children["dit"].answer()
    return {"wall_s": time.perf_counter() - t0, "cpu_s": ar["cpu_s"] + dit["cpu_s"], "ar_s": ar["s"], "dit_s": dit["s"]}


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # a kill stops what it started (the finally blocks, atexit)
    p = argparse.ArgumentParser(prog="python -m bench.turns", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--child", choices=("ar", "dit"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    models_dir = ROOT / "models"
    if args.child:
        serve(args.child, models_dir)
        return 0
    print(f"loading the AR and the DiT engine, each in its own process ({JOBS} jobs: AR {AR_TOKENS} tokens, "
          f"DiT 32 px x 20 steps in batches of {BATCH}) ...", flush=True)
    children = {kind: DirectProcess([sys.executable, "-m", "bench.turns", "--child", kind],
                                    ROOT / "logs" / f"turns-{kind}.log") for kind in ("ar", "dit")}
    seen: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        turns_file = Path(tmp) / "engine-turns"
        try:
            for rep in range(args.reps):
                order = ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)]  # each arm leads in turn
                for arm in order:
                    r = one_rep(children, arm, rep, turns_file)
                    seen[arm].append(r)
                    print(f"  rep {rep} {arm:20s} {r['wall_s']:6.2f} s, CPU {r['cpu_s']:6.2f} s "
                          f"(AR done after {r['ar_s']:.2f} s, DiT after {r['dit_s']:.2f} s)", flush=True)
        finally:
            for child in children.values():
                with child:
                    child.close()
    base = seen[ARMS[0]]
    print(f"\n{'arm':22s} {'wall s':>8s} {'CPU s':>8s}  throughput against one after the other (median, per rep)")
    for arm in ARMS:
        runs = seen[arm]
        ratios = [round(b["wall_s"] / r["wall_s"], 3) for b, r in zip(base, runs, strict=True)]
        print(f"{arm:22s} {statistics.median(r['wall_s'] for r in runs):8.2f} "
              f"{statistics.median(r['cpu_s'] for r in runs):8.2f}  {statistics.median(ratios):.3f} {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
