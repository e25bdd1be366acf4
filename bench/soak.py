"""Soak: run N jobs through the real system and check that no process's memory grows with them.

    python -m bench.soak                 # 2,000 jobs (text-to-text and text-to-image, mixed)
    python -m bench.soak --jobs 500      # shorter

It starts the system as ``omni-jobs up`` does (its own Redis with AOF, the API, one Celery worker
per queue), keeps ``--in-flight`` jobs submitted at a time through the HTTP API, and reads each
process's resident memory (VmRSS) when the ``--warm``-th job has finished and again after the last
one. A process whose RSS after the last job is more than 10% above its RSS after the warm-up is
reported as growing, and the exit status is 1. Redis is shown but not judged: it holds every job
kept until retention removes it, so it grows by a few KB per job by design. Engines load and allocators settle during the first
jobs, so the first sample is taken after them, not at start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.procfs import memory_mib
from omni_jobs.core.settings import Settings
from omni_jobs.local.devservices import exit_on_sigterm
from omni_jobs.local.embedded import EmbeddedSystem

ROOT = Path(__file__).resolve().parents[1]
GROWTH_LIMIT = 1.10


@dataclass
class Sample:
    finished: int
    at_s: float
    rss_mib: dict[str, float]


def job_body(i: int) -> dict[str, Any]:
    """Every third job makes an image; the rest are short text jobs (both run the AR stage)."""
    prompt = f"soak job {i}: a lighthouse on a cliff, variation {i % 97}"
    if i % 3 == 0:
        return {"pipeline": "text-to-image", "input": {"prompt": prompt},
                "params": {"ar": {"max_tokens": 4}, "dit": {"num_inference_steps": 2, "height": 32, "width": 32,
                                                           "seed": i}}}
    return {"pipeline": "text-to-text", "input": {"prompt": prompt}, "params": {"ar": {"max_tokens": 8}}}


def snapshot(system: EmbeddedSystem) -> dict[str, float]:
    return {proc.name: round(memory_mib(proc.pid, "VmRSS"), 1) for proc in system.processes
            if proc.pid and proc.name != "redis"}


def run(system: EmbeddedSystem, jobs: int, in_flight: int, warm: int) -> tuple[list[Sample], dict[str, int]]:
    headers = {"Authorization": f"Bearer {system.api_key}"} if system.api_key else {}
    api = httpx.Client(base_url=system.api_url, headers=headers, timeout=60)
    pending: set[str] = set()
    statuses: dict[str, int] = {}
    samples: list[Sample] = []
    submitted = finished = 0
    started = time.monotonic()
    next_report = 0.0
    while finished < jobs:
        while submitted < jobs and len(pending) < in_flight:
            response = api.post("/v1/jobs", json=job_body(submitted))
            response.raise_for_status()
            pending.add(response.json()["id"])
            submitted += 1
        for job_id in list(pending):
            status = api.get(f"/v1/jobs/{job_id}").json()["status"]
            if status in ("succeeded", "failed", "canceled"):
                pending.discard(job_id)
                statuses[status] = statuses.get(status, 0) + 1
                finished += 1
                if finished in (warm, jobs):
                    samples.append(Sample(finished, time.monotonic() - started, snapshot(system)))
        now = time.monotonic()
        if now >= next_report:
            print(f"  {finished}/{jobs} finished, {len(pending)} in flight, {now - started:.0f}s", flush=True)
            next_report = now + 15
        time.sleep(0.25)
    api.close()
    return samples, statuses


def table(samples: list[Sample]) -> tuple[str, bool]:
    first, last = samples[0], samples[-1]
    header = (f"{'process':18} {f'RSS after {first.finished}':>16} {f'RSS after {last.finished}':>16} "
              f"{'ratio':>7}  verdict")
    lines = [header, "-" * 70]
    ok = True
    for name in sorted(first.rss_mib):
        a, b = first.rss_mib[name], last.rss_mib.get(name, float("nan"))
        ratio = b / a if a else float("nan")
        if name == "redis-server":  # it holds the jobs kept (retention), so it grows by design
            per_job_kb = (b - a) * 1024 / (last.finished - first.finished)
            verdict = f"holds the kept jobs: {per_job_kb:.1f} KB per job (not judged)"
        else:
            flat = ratio <= GROWTH_LIMIT
            ok &= flat
            verdict = "flat" if flat else "GROWS (> 10%)"
        lines.append(f"{name:18} {a:>13.1f} MiB {b:>12.1f} MiB {ratio:>7.3f}  {verdict}")
    return "\n".join(lines), ok


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2000, help="jobs in all (default %(default)s)")
    parser.add_argument("--warm", type=int, default=200, help="the first RSS sample is taken after this many")
    parser.add_argument("--in-flight", type=int, default=64, help="jobs submitted and not yet finished")
    parser.add_argument("--json", type=Path, help="also write the samples here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # a kill stops what it started (the finally blocks, atexit)
    args = parse(argv)
    if not 0 < args.warm < args.jobs:
        raise SystemExit("--warm must be between 0 and --jobs")
    home = Path(tempfile.mkdtemp(prefix="omni-soak-"))
    settings = Settings(models_dir=(ROOT / "var" / "models").resolve(), artifacts_dir=home / "artifacts",
                        redis_url="redis://unused")
    env = {"OMNI_AUTH_ENABLED": "false", "OMNI_LOG_FORMAT": "text", "OMNI_MAX_QUEUED_PER_QUEUE": "100000"}
    os.environ.update(env)
    system = EmbeddedSystem(settings=settings, home=home, extra_env=env, with_flower=False)
    system.start(say=lambda m: print(f"  [system] {m}", flush=True))
    try:
        samples, statuses = run(system, args.jobs, args.in_flight, args.warm)
    finally:
        system.stop()
    text, ok = table(samples)
    print(f"\nbench.soak: {args.jobs} jobs ({statuses}) in {samples[-1].at_s:.0f}s, "
          f"{args.in_flight} in flight; RSS (VmRSS) per process\n")
    print(text)
    print(f"\nevery API and worker process within {GROWTH_LIMIT - 1:.0%} of its RSS after job {args.warm}: "
          f"{'yes' if ok else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps([s.__dict__ for s in samples], indent=2))
    succeeded = statuses.get("succeeded", 0) == args.jobs
    if not succeeded:
        print(f"not every job succeeded: {statuses}")
    if ok and succeeded:
        shutil.rmtree(home, ignore_errors=True)  # ~60 MB of outputs, AOF and logs per run
        return 0
    print(f"kept for a look: {home} (logs/, the Redis AOF, the outputs)")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
