"""What a stage worker's periodic writes cost: lease renewals and progress, one commit each vs one round trip.

``python -m bench.worker_writes`` starts a private redis-server, runs N stages (default 64: a worker's
in-flight tasks) to their running state through the ledger, and times, side by side in one run:

* renewing every lease: one commit per lease, as before, vs ``JobLedger.renew`` (``commit_each``);
* writing every stage's progress: one ``progress`` per stage vs ``progress_many``;
* appending a text delta to every stage's job stream (an AR engine step of a batch): one ``publish``
  per stage vs ``publish_many`` (what the text writer does now for the deltas due together).

A batched engine's worker does both for all its members at once (the lease keeper every lease_s / 3,
the progress writer every progress_interval_s), from threads that share the CPU with the engine:
fewer round trips mean fewer wake-ups taken from it. It prints medians and their ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

from omni_jobs.core.json_types import JsonObject
from omni_jobs.dispatch.scheduling import Scheduler
from omni_jobs.jobs.ledger import Acquired, JobLedger
from omni_jobs.jobs.models import EventType, Job, StageRecord, new_job_id, now
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.local.devservices import exit_on_sigterm, start_redis


def running_stages(ledger: JobLedger, n: int) -> list[Acquired]:
    """N one-stage jobs whose stage a worker has taken (the leases and snapshots it then holds)."""
    store = ledger.store
    for _ in range(n):
        ledger.submit(Job(id=new_job_id(), pipeline="bench", input={},
                          stages=[StageRecord(id="dit", engine="dit", queue="dit")]), ["dit"])
    Scheduler(store, None).release_all()
    entries = store.claim_outbox(now=now(), limit=n, hold_s=60.0)
    store.ack_outbox([e.id for e in entries])
    taken = [ledger.acquire(e.step, worker="bench", owner=f"bench#{i}") for i, e in enumerate(entries)]
    acquired = [t for t in taken if isinstance(t, Acquired)]
    assert len(acquired) == n, taken
    return acquired


def median_ms(call: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # a kill stops what it started (the finally blocks, atexit)
    p = argparse.ArgumentParser(prog="python -m bench.worker_writes", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=64, help="running stages of one worker (default 64)")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per arm (default 20)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as home, start_redis(data_dir=Path(home)) as server:
        ledger = JobLedger(RedisJobStore(redis.Redis.from_url(server.url), ttl_s=600))
        taken = running_stages(ledger, args.stages)
        leases = [t.lease for t in taken]
        reports = [(t.lease, t.job, 3, 20, "steps") for t in taken]
        delta: JsonObject = {"stage": "dit", "output": "text", "text": " token", "index": 0, "attempt": 1}
        deltas = [(t.lease, t.job, EventType.output_delta, delta) for t in taken]
        rows = []
        for _ in range(3):  # the arms take turns: both see the same machine
            one = median_ms(lambda: [ledger.renew([lease]) for lease in leases], args.reps)
            together = median_ms(lambda: ledger.renew(leases), args.reps)
            rows.append(("renew", one, together))
            one = median_ms(lambda: [ledger.progress(*r) for r in reports], max(3, args.reps // 4))
            together = median_ms(lambda: ledger.progress_many(reports), max(3, args.reps // 4))
            rows.append(("progress", one, together))
            one = median_ms(lambda: [ledger.publish(*d) for d in deltas], max(3, args.reps // 4))
            together = median_ms(lambda: ledger.publish_many(deltas), max(3, args.reps // 4))
            rows.append(("deltas", one, together))
        print(f"{args.stages} running stages, medians of 3 rounds (ms per pass over all of them):")
        for what in ("renew", "progress", "deltas"):
            ones = [r[1] for r in rows if r[0] == what]
            togethers = [r[2] for r in rows if r[0] == what]
            ratios = [b / a for a, b in zip(ones, togethers, strict=True)]
            print(f"  {what:9} one commit each {statistics.median(ones):6.1f} ms | one round trip "
                  f"{statistics.median(togethers):6.1f} ms | ratio {statistics.median(ratios):.2f} "
                  f"(rounds {[round(r, 2) for r in ratios]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
