"""What other work costs a running DiT engine: a thread of its own process against another process.

    python -m bench.wakeups                              # 80 wake-ups a second of 0.08 ms each
    python -m bench.wakeups --burst-ms 0.64 --gap-ms 96  # the same CPU in 8x fewer, longer wake-ups

One process loads the benchmark's small DiT (32 px, batches of 32, 20 steps, its OpenMP team on every
core) and times the same batches in turns: alone; beside a thread of the same process
that wakes every ``--gap-ms`` and runs Python for ``--burst-ms``; beside another process doing the
same. Both take the same CPU. A stage worker's Python (its tasks, Celery's consumer) is the first
kind; a Redis command, the API, the driver are the second. A fourth arm is the worker's own pattern:
a thread of the engine's process that sends Redis a PING at each wake-up (another process, Redis,
wakes to answer it). It prints each arm's median batch time
over ``alone``, beside the share of a core the other work used (docs/decisions/another-process-wakeups.md).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from bench.run import DIT_SMALL, ROOT, as_engine_process, generate_images, prompts
from omni_jobs.local.devservices import exit_on_sigterm

ARMS = ("alone", "thread", "process", "redis")


class Flag(Protocol):
    def is_set(self) -> bool: ...
    def set(self) -> None: ...


def busy(stop: Flag, burst_s: float, gap_s: float, nice: int = 0) -> None:
    """Wake every ``gap_s`` and hold a core (and the interpreter) for ``burst_s``, until ``stop``."""
    if nice:
        os.nice(nice)
    while not stop.is_set():
        began = time.perf_counter()
        while time.perf_counter() - began < burst_s:
            pass
        time.sleep(gap_s)


def ping(stop: Flag, url: str, gap_s: float) -> None:
    """Send Redis a command every ``gap_s`` (a stage worker's round trip), until ``stop``."""
    import redis

    client = redis.Redis.from_url(url)
    while not stop.is_set():
        client.ping()
        time.sleep(gap_s)
    client.close()


def beside(arm: str, burst_s: float, gap_s: float, nice: int, redis_url: str) -> Callable[[], None]:
    """Start the other work of ``arm``; returns what stops it."""
    flag: Flag
    if arm == "redis":
        flag = threading.Event()
        worker: threading.Thread | Any = threading.Thread(target=ping, args=(flag, redis_url, gap_s), daemon=True)
    elif arm == "thread":
        flag = threading.Event()
        worker = threading.Thread(target=busy, args=(flag, burst_s, gap_s), daemon=True)
    elif arm == "process":
        fork = mp.get_context("fork")
        flag = fork.Event()
        worker = fork.Process(target=busy, args=(flag, burst_s, gap_s, nice), daemon=True)
    else:
        return lambda: None
    worker.start()
    time.sleep(0.2)

    def stop() -> None:
        flag.set()
        worker.join()

    return stop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--burst-ms", type=float, default=0.08, help="CPU of each wake-up of the other work")
    p.add_argument("--gap-ms", type=float, default=12.0, help="sleep between two wake-ups")
    p.add_argument("--rounds", type=int, default=3, help="turns of the three arms (2 batches of 32 each)")
    p.add_argument("--nice", type=int, default=0, help="the other process's niceness")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                   help="the 'redis' arm: a thread of this process sends this Redis a PING every --gap-ms")
    args = p.parse_args(argv)
    exit_on_sigterm()
    as_engine_process()  # the engines' library settings and malloc, as a worker's
    from omni_jobs.engines.dit import DiTEngine
    from omni_jobs.pipelines.model_source import resolve_model

    engine = DiTEngine(resolve_model(DIT_SMALL, (ROOT / "models").resolve()), pipeline_class="PixArtSigmaPipeline")
    generate_images(engine, prompts(32, 999), 32, 20, 32)  # warm: the first call at a batch size allocates
    burst_s, gap_s = args.burst_ms / 1000, args.gap_ms / 1000
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS:
            stop = beside(arm, burst_s, gap_s, args.nice, args.redis_url)
            began = time.perf_counter()
            generate_images(engine, prompts(64, r), 32, 20, 32)
            times[arm].append(time.perf_counter() - began)
            stop()
            print(f"  round {r + 1} {arm:8s} {times[arm][-1]:.3f} s", flush=True)
    alone = statistics.median(times["alone"])
    share = burst_s / (burst_s + gap_s)
    print(f"\nother work: {1 / (burst_s + gap_s):.0f} wake-ups/s of {args.burst_ms:g} ms, {share:.1%} of a core")
    for arm in ARMS:
        median = statistics.median(times[arm])
        print(f"{arm:8s} {median:.3f} s  x{median / alone:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
