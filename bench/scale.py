"""Does a request cost the same with a million jobs kept as with a thousand?

    python -m bench.scale [--sizes 1000,100000,1000000] [--samples 200]

It fills a fresh Redis with finished jobs written straight in the system's own format (the job hash,
its indexes, an event, a small intermediate in Redis with its job's artifact set: what a finished
job leaves), runs a real API process on it (no workers, no engines), and at each size measures:
POST /v1/jobs and GET /v1/jobs/{id}; the list's first page, unfiltered and filtered by a rare
status; /readyz and /metrics; and one retention pass that deletes 1,000 expired jobs. It prints
the p50 of each (ms) and its ratio to the smallest size, and Redis memory per job. Every figure
should stay within 2x of its value at the smallest size.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx
import redis

from omni_jobs.accept.submission import build_job, resolve_params
from omni_jobs.artifacts import ArtifactRef, ArtifactStore, LocalBackend, RedisBackend
from omni_jobs.core import keys
from omni_jobs.dispatch.retention import cleanup
from omni_jobs.jobs import codec
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import EventType, Job, JobEvent, JobOutput, JobStatus, StageStatus, new_job_id, now
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.local.devservices import RunningService, exit_on_sigterm, free_port, start_redis
from omni_jobs.pipelines.catalogue import load_catalogue

REPO = Path(__file__).resolve().parents[1]
DAY = 24 * 3600
TTL_S = 8 * DAY


SPEC = load_catalogue().get("text-to-text")
TEMPLATE = build_job(SPEC, {"prompt": "a short prompt for a finished job"}, resolve_params(SPEC, {}))


def finished_job(status: JobStatus, created_at: float) -> Job:
    job = TEMPLATE.model_copy(deep=True)
    job.id = new_job_id()
    job.tenant = "default"  # the API runs with auth off: every caller is tenant default
    job.created_at = job.started_at = created_at
    job.completed_at = created_at + 1.5
    job.status = status
    record = job.stages[0]
    record.status = StageStatus.succeeded if status is JobStatus.succeeded else StageStatus.failed
    record.queued_at, record.started_at, record.finished_at, record.attempts = created_at, created_at, created_at + 1, 1
    job.results.status = StageStatus.succeeded if status is JobStatus.succeeded else StageStatus.pending
    return job


PAYLOAD = b'{"text": "x"}'
PAYLOAD_SHA256 = hashlib.sha256(PAYLOAD).hexdigest()


def write_jobs(client: redis.Redis, n: int, *, status: JobStatus = JobStatus.succeeded,
               age_s: float = 2 * 3600) -> list[str]:
    """``n`` finished jobs as the ledger leaves them, in pipelined batches."""
    ids: list[str] = []
    for start in range(0, n, 1000):
        with client.pipeline(transaction=False) as pipe:
            for _ in range(min(1000, n - start)):
                job = finished_job(status, now() - age_s)
                key = keys.intermediate_artifact(job.id, "ar", "text.json", 1)
                ref = ArtifactRef(backend="redis", key=key, media_type="application/json", size=len(PAYLOAD),
                                  sha256=PAYLOAD_SHA256)
                pipe.set(keys.artifact(key), PAYLOAD, ex=DAY)  # what RedisBackend.put writes, pipelined here
                pipe.sadd(keys.job_artifacts(job.id), key)
                pipe.expire(keys.job_artifacts(job.id), DAY)
                job.stage_record("ar").outputs = {"text": ref}
                job.outputs = [JobOutput(name="text", type="text", media_type="application/json", size=ref.size,
                                         artifact=ref, text="x")]
                pipe.hset(keys.job(job.id), mapping=cast(Any, codec.encode(job)))
                pipe.expire(keys.job(job.id), TTL_S)
                for index in (keys.JOBS_INDEX, keys.tenant_jobs(job.tenant), keys.jobs_by_status(job.status.value),
                              keys.jobs_by_status(job.status.value, job.tenant)):
                    pipe.zadd(index, {job.id: job.created_at})
                event = JobEvent(job_id=job.id, type=EventType.job_succeeded, at=job.completed_at or 0)
                pipe.xadd(keys.job_events(job.id), {"event": event.model_dump_json(exclude={"id"})})
                ids.append(job.id)
            pipe.execute()
    return ids


def p50_ms(samples: int, call: Callable[[int], object]) -> float:
    times = []
    for i in range(samples):
        started = time.perf_counter()
        call(i)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def start_api(redis_url: str, home: Path) -> RunningService:
    port = free_port()
    env = {**os.environ, "OMNI_REDIS_URL": redis_url, "OMNI_AUTH_ENABLED": "false", "OMNI_LOG_LEVEL": "WARNING",
           "OMNI_MAX_QUEUED_PER_QUEUE": "10000000", "OMNI_ARTIFACTS_DIR": str(home / "artifacts")}

    def ready() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    return RunningService("api", [sys.executable, "-m", "uvicorn", "api.main:app", "--port", str(port),
                                  "--log-level", "warning"], port, f"api:{port}", ready,
                          log_path=home / "api.log", start_timeout_s=60, cwd=REPO, env=env).start()


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # a kill stops what it started (the finally blocks, atexit)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,100000,1000000")
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: list[tuple[int, dict[str, float], float]] = []
    with tempfile.TemporaryDirectory(prefix="omni-scale-") as tmp:
        home = Path(tmp)
        with start_redis(data_dir=home / "redis") as service:
            client = redis.Redis.from_url(service.url)
            artifacts = ArtifactStore(LocalBackend(home / "artifacts"), RedisBackend(client), small_max_bytes=1024)
            ledger = JobLedger(RedisJobStore(client, ttl_s=TTL_S))
            write_jobs(client, 5, status=JobStatus.failed)  # the rare status the filtered list asks for
            kept: list[str] = []
            api = start_api(service.url, home)
            try:
                http = httpx.Client(base_url=f"http://127.0.0.1:{api.port}", timeout=60)
                for size in sizes:
                    print(f"filling to {size:,} jobs ...", flush=True)
                    kept += write_jobs(client, size - len(kept))
                    figures: dict[str, float] = {}
                    ids = list(kept)

                    def post(_i: int) -> object:
                        return http.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "hello"}})

                    def get(i: int, ids: list[str] = ids) -> object:
                        return http.get(f"/v1/jobs/{ids[(i * 7919) % len(ids)]}").raise_for_status()

                    figures["POST /v1/jobs"] = p50_ms(args.samples, post)
                    figures["GET /v1/jobs/{id}"] = p50_ms(args.samples, get)
                    figures["list, first page"] = p50_ms(50, lambda i: http.get("/v1/jobs?limit=20").raise_for_status())
                    figures["list ?status=failed"] = p50_ms(50, lambda i: http.get(
                        "/v1/jobs?limit=20&status=failed").raise_for_status())
                    figures["/readyz"] = p50_ms(20, lambda i: http.get("/readyz"))
                    figures["/metrics"] = p50_ms(20, lambda i: http.get("/metrics").raise_for_status())
                    expired = write_jobs(client, 1000, age_s=9 * DAY)
                    started = time.perf_counter()
                    report = cleanup(ledger, artifacts, output_ttl_s=7 * DAY, intermediate_ttl_s=DAY)
                    figures["cleanup of 1,000 expired"] = (time.perf_counter() - started) * 1000
                    assert report.jobs_expired == len(expired), report
                    memory = int(client.info("memory")["used_memory"]) / max(1, int(client.zcard(keys.JOBS_INDEX)))
                    rows.append((size, figures, memory))
                    print(f"  {size:,} jobs: " + ", ".join(f"{k} {v:.1f} ms" for k, v in figures.items()), flush=True)
            finally:
                api.stop()
    base = rows[0][1]
    names = list(base)
    print("\np50 ms (x the first size); cleanup: one pass\n")
    print("| jobs kept | " + " | ".join(names) + " | Redis bytes/job |")
    print("|---" * (len(names) + 2) + "|")
    worst = 0.0
    for size, figures, memory in rows:
        cells = [f"{figures[n]:.1f} ({figures[n] / base[n]:.2f})" for n in names]
        worst = max(worst, *(figures[n] / base[n] for n in names))
        print(f"| {size:,} | " + " | ".join(cells) + f" | {memory:,.0f} |")
    print(f"\nworst ratio to the first size: {worst:.2f} ({'within' if worst <= 2 else 'NOT within'} 2x)")
    return 0 if worst <= 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
