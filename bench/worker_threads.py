"""Where a stage worker's CPU goes, thread by thread, per job.

    python -m bench.worker_threads [--only "DiT 32px small"] [--jobs 64] [--reps 6]

Starts the system as ``python -m bench`` does, runs one workload's jobs through it (the system arm
alone: no direct arm, no naive arm), and prints the CPU each process spent per job, then the stage
worker's threads grouped by name: the engine's thread, Celery's consumer (``MainThread``), its task
threads (``ThreadPoolExecutor-0``), the outbox relay, the progress writer... and the native threads
with no Python frames (OpenMP's team, gloo's loops).

Each thread's CPU is read from /proc/<pid>/task/<tid>/schedstat, in nanoseconds. /proc's ``stat``
counts 10 ms ticks: per thread, over a few hundred jobs, that put the 64 task threads at 0.4-1.0 ms a
job, where their real total is ~3.7. Names come from one ``py-spy dump`` of the worker (``pip install py-spy``);
without it the threads are listed by id.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from bench.procfs import thread_cpu_s, thread_wakeups
from bench.run import WORKLOADS, Bench, data_uri, images, parse, prompts
from omni_jobs.local.devservices import exit_on_sigterm

NATIVE = "native (no Python frames)"
_THREAD = re.compile(r'^Thread (\d+) \([^)]*\): "([^"]*)"', re.MULTILINE)


def thread_names(dump: str) -> dict[int, str]:
    """Thread id -> Python thread name, from ``py-spy dump`` output (``Thread 1234 (idle): "name"``)."""
    return {int(m.group(1)): m.group(2) for m in _THREAD.finditer(dump)}


def group_name(name: str) -> str:
    """A pool's threads as one group: ``ThreadPoolExecutor-0_31`` -> ``ThreadPoolExecutor-0``."""
    return re.sub(r"_\d+$", "", name)


def by_group(before: Mapping[int, float], after: Mapping[int, float],
             names: Mapping[int, str]) -> dict[str, tuple[float, int]]:
    """CPU seconds and thread count per thread group between two readings; threads py-spy did not
    name are native threads (no Python frames) when names were read, else listed by id."""
    groups: dict[str, tuple[float, int]] = {}
    for tid, cpu in after.items():
        name = group_name(names[tid]) if tid in names else NATIVE if names else f"thread {tid}"
        spent, count = groups.get(name, (0.0, 0))
        groups[name] = (spent + cpu - before.get(tid, 0.0), count + 1)
    return groups


def py_spy_dump(pid: int) -> str:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        print("  (py-spy is not installed: threads are listed by id; `pip install py-spy` names them)")
        return ""
    return subprocess.run([exe, "dump", "-p", str(pid)], check=False, capture_output=True, text=True, timeout=60).stdout


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(prog="python -m bench.worker_threads", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="DiT 32px small", help="the workload (a substring of its name in bench.run)")
    p.add_argument("--jobs", type=int, default=64, help="jobs per repetition (posted at once)")
    p.add_argument("--reps", type=int, default=6, help="measured repetitions (after 2 unmeasured ones)")
    p.add_argument("--process", default=None, help="whose threads to list (default: the workload's stage worker; "
                   "e.g. ar, results, api: what a process that has no part in the jobs spends meanwhile)")
    p.add_argument("--engine-workers", type=int, default=1, metavar="N",
                   help="N workers per stage queue, as `python -m bench --engine-workers N`; the threads listed are "
                        "the first one's, per job it ran (~1/N of them)")
    args = p.parse_args(argv)
    (workload,) = [w for w in WORKLOADS if args.only in w.name]
    worker = args.process or {"ar": "ar", "vlm": "ar", "dit": "dit", "multi": "dit"}[workload.kind]

    def job_images(rep: int) -> list[str] | None:  # the image+text row's inputs, made before any CPU is read
        return [data_uri(png) for png in images(args.jobs, rep)] if workload.kind == "vlm" else None

    bench = Bench(parse(["--jobs", str(args.jobs), "--no-naive", "--engine-workers", str(args.engine_workers)]))
    try:
        bench.start()
        for rep in range(2):  # warm: first calls at each batch size, the prefix caches of the prompts
            bench.run_jobs(workload.pipeline, prompts(args.jobs, 900 + rep), image_uris=job_images(900 + rep))
        uris = [job_images(rep) for rep in range(args.reps)]
        pid = bench.processes()[worker]
        names = thread_names(py_spy_dump(pid))
        procs_before, threads_before, woken_before = bench.cpu_times(), thread_cpu_s(pid), thread_wakeups(pid)
        for rep in range(args.reps):
            bench.run_jobs(workload.pipeline, prompts(args.jobs, rep), image_uris=uris[rep])
        procs_after, threads_after, woken_after = bench.cpu_times(), thread_cpu_s(pid), thread_wakeups(pid)
    finally:
        bench.stop()
    n = args.jobs * args.reps
    print(f"\n{workload.name}: {n} jobs ({args.reps} x {args.jobs}); CPU ms a job")
    by_process = {k: v - procs_before.get(k, 0.0) for k, v in procs_after.items()}
    print("by process: " + ", ".join(f"{k} {1000 * v / n:.2f}"
                                     for k, v in sorted(by_process.items(), key=lambda kv: -kv[1])))
    n_worker = n / args.engine_workers if worker in ("ar", "dit") and args.process is None else n
    print(f"the threads of {worker}: CPU ms and wake-ups (voluntary context switches) a job"
          + (f" it ran (~{n_worker:.0f})" if n_worker != n else ""))
    groups = by_group(threads_before, threads_after, names)
    woken = by_group({t: float(v) for t, v in woken_before.items()}, {t: float(v) for t, v in woken_after.items()},
                     names)
    for name, (spent, count) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        if spent * 1000 / n_worker >= 0.005:
            print(f"  {1000 * spent / n_worker:8.3f} {woken.get(name, (0.0, 0))[0] / n_worker:7.1f}  {name}"
                  + (f" ({count} threads)" if count > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
