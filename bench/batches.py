"""Batches (OpenAI's Batch API) at scale: how fast a big file is accepted, what a line costs in Redis,
the API's memory, and a text batch's lines/s against the same requests sent one by one.

    python -m bench.batches [--lines 10000] [--run-lines 1000] [--in-flight 64]

It starts the system as ``omni-jobs up`` does (its own Redis, the API, an AR worker and a results
worker, which runs the batch driver), then:

1. uploads a ``--lines``-line chat file (POST /v1/files: every line checked by the chat route's own
   model, plan and the submitter's validation) and creates its batch (POST /v1/batches), three times:
   the seconds each takes (issue 64's target: accepted and validated in under 10 s), and the API's
   RSS before, after each, and at the end;
2. cancels those batches (nothing of them runs) and times their finalize, which writes every line to the
   error file;
3. runs a ``--run-lines``-line text-to-text batch and, in turns, the same requests POSTed one by one to
   /v1/chat/completions with ``--in-flight`` in flight: lines/s of each;
4. reads, with Redis's MEMORY USAGE, what the batch keeps in Redis per line (its record, its line ->
   job map, its pending set) and the peak of its unended jobs (at most OMNI_BATCH_MAX_IN_FLIGHT);
5. interactive latency: the p50 of ``--interactive`` chat requests sent one after another (same tenant,
   priority normal), alone (before and after) and while a ``--lines``-line batch runs (issue 64's target:
   within 1.5x);
6. the API's RSS, at the start, after each upload and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.procfs import memory_mib
from omni_jobs.core import keys
from omni_jobs.core.settings import Settings
from omni_jobs.local.devservices import free_port
from omni_jobs.local.embedded import EmbeddedSystem

ROOT = Path(__file__).resolve().parents[1]


def chat_rows(n: int, tag: str) -> list[dict[str, Any]]:
    return [{"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "text-to-text", "max_tokens": 4, "temperature": 0,
                      "messages": [{"role": "user", "content": f"Once upon a time, number {i}"}]}} for i in range(n)]


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def wait_ended(api: httpx.Client, batch_id: str, timeout_s: float = 3600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch: dict[str, Any] = api.get(f"/v1/batches/{batch_id}").raise_for_status().json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.2)
    raise SystemExit(f"batch {batch_id} did not end within {timeout_s}s")


def accept(api: httpx.Client, data: bytes) -> tuple[float, float, str]:
    """(seconds to upload and check the file, seconds to create its batch, the batch id)."""
    started = time.perf_counter()
    made = api.post("/v1/files", files={"file": ("big.jsonl", data)}, data={"purpose": "batch"}, timeout=600)
    uploaded = time.perf_counter()
    made.raise_for_status()
    batch = api.post("/v1/batches", json={"input_file_id": made.json()["id"], "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h"}, timeout=600).raise_for_status().json()
    return uploaded - started, time.perf_counter() - uploaded, str(batch["id"])


def batch_bytes(client: redis.Redis, batch_id: str) -> int:
    """What the batch's own keys hold in Redis (MEMORY USAGE, samples 0: every element counted)."""
    total = 0
    for key in (keys.batch(batch_id), keys.batch_lines(batch_id), keys.batch_pending(batch_id)):
        used = client.memory_usage(key, samples=0)
        total += int(used or 0)
    return total


def run_batch(api: httpx.Client, client: redis.Redis, rows: list[dict[str, Any]]) -> tuple[float, int, int]:
    """(seconds from create to completed, peak pending lines, the batch's Redis bytes at the end)."""
    file_id = api.post("/v1/files", files={"file": ("run.jsonl", jsonl(rows))},
                       data={"purpose": "batch"}).raise_for_status().json()["id"]
    started = time.perf_counter()
    batch_id = api.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                             "completion_window": "24h"}).raise_for_status().json()["id"]
    peak = 0
    while True:
        peak = max(peak, int(client.scard(keys.batch_pending(batch_id))))
        batch = api.get(f"/v1/batches/{batch_id}").raise_for_status().json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            break
        time.sleep(0.2)
    took = time.perf_counter() - started
    if batch["status"] != "completed" or batch["request_counts"]["failed"]:
        raise SystemExit(f"the run batch did not complete cleanly: {batch}")
    return took, peak, batch_bytes(client, batch_id)


def one_by_one(api: httpx.Client, rows: list[dict[str, Any]], in_flight: int) -> float:
    """Seconds for the same requests POSTed to /v1/chat/completions, ``in_flight`` at a time."""
    def post(row: dict[str, Any]) -> None:
        api.post("/v1/chat/completions", json=row["body"], timeout=600).raise_for_status()

    started = time.perf_counter()
    with ThreadPoolExecutor(in_flight) as pool:
        list(pool.map(post, rows))
    return time.perf_counter() - started


def interactive_p50(api: httpx.Client, n: int) -> float:
    """The median seconds of ``n`` chat requests sent one after another."""
    took = []
    for i in range(n):
        started = time.perf_counter()
        api.post("/v1/chat/completions", json={"model": "text-to-text", "max_tokens": 4, "temperature": 0,
                                               "messages": [{"role": "user", "content": f"Hello {i}"}]},
                 timeout=600).raise_for_status()
        took.append(time.perf_counter() - started)
    return sorted(took)[len(took) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batches", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=10_000, help="lines of the file accepted (default %(default)s)")
    parser.add_argument("--run-lines", type=int, default=1000, help="lines of the batch that runs (default %(default)s)")
    parser.add_argument("--in-flight", type=int, default=64, help="requests in flight one by one (default %(default)s)")
    parser.add_argument("--reps", type=int, default=3, help="uploads of the big file (default %(default)s)")
    parser.add_argument("--interactive", type=int, default=30, help="interactive requests per arm (default %(default)s)")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="OMNI_BATCH_MAX_IN_FLIGHT for the run (default: the setting's default)")
    args = parser.parse_args(argv)
    home = Path(tempfile.mkdtemp(prefix="omni-bench-batches-"))
    settings = Settings(models_dir=(ROOT / "var" / "models").resolve(), artifacts_dir=home / "artifacts",
                        redis_url="redis://unused")
    env = {"OMNI_AUTH_ENABLED": "false", "OMNI_LOG_FORMAT": "text", "OMNI_MAX_QUEUED_PER_QUEUE": "100000",
           "OMNI_MAX_REQUEST_BYTES": str(64 * 1024 * 1024), "OMNI_BATCH_FILE_MAX_BYTES": str(64 * 1024 * 1024)}
    if args.max_in_flight is not None:
        env["OMNI_BATCH_MAX_IN_FLIGHT"] = str(args.max_in_flight)
    os.environ.update(env)
    system = EmbeddedSystem(settings=settings, home=home, extra_env=env, with_flower=False, api_port=free_port(),
                            worker_queues={"ar": "threads", "results": "solo"})
    system.start(say=lambda m: print(f"  [system] {m}", flush=True))
    try:
        api_pid = next(p.pid for p in system.processes if p.name == "api")
        assert api_pid is not None
        client = redis.Redis.from_url(str(system.redis_url))
        with httpx.Client(base_url=system.api_url, timeout=120) as api:
            big = jsonl(chat_rows(args.lines, "big"))
            rss = [memory_mib(api_pid, "VmRSS")]
            print(f"\n1. a {args.lines:,}-line chat file ({len(big) / 1e6:.1f} MB) accepted and checked, then its batch made")
            ids = []
            for rep in range(args.reps):
                upload_s, create_s, batch_id = accept(api, big)
                ids.append(batch_id)
                rss.append(memory_mib(api_pid, "VmRSS"))
                print(f"   rep {rep + 1}: POST /v1/files {upload_s:.2f} s, POST /v1/batches {create_s:.2f} s "
                      f"({args.lines / (upload_s + create_s):,.0f} lines/s); API RSS {rss[-1]:.1f} MiB")
            started = time.perf_counter()
            for batch_id in ids:
                api.post(f"/v1/batches/{batch_id}/cancel").raise_for_status()
            ran = 0
            for batch_id in ids:
                ended = wait_ended(api, batch_id)
                counts = ended["request_counts"]
                assert counts["completed"] + counts["failed"] == args.lines, ended
                ran += counts["completed"]
            print(f"2. {len(ids)} cancelled: finalized in {time.perf_counter() - started:.1f} s for "
                  f"{len(ids) * args.lines:,} lines ({ran} had run; the rest are batch_cancelled in the error file)")
            rows = chat_rows(args.run_lines, "run")
            in_batch, peak, kept = run_batch(api, client, rows)
            direct = one_by_one(api, rows, args.in_flight)
            in_batch2, peak2, kept2 = run_batch(api, client, chat_rows(args.run_lines, "run2"))
            direct2 = one_by_one(api, rows, args.in_flight)
            batch_rate = 2 * args.run_lines / (in_batch + in_batch2)
            direct_rate = 2 * args.run_lines / (direct + direct2)
            print(f"3. {args.run_lines:,}-line text batch: {in_batch:.1f} s, {in_batch2:.1f} s "
                  f"({batch_rate:.1f} lines/s); one by one, {args.in_flight} in flight: {direct:.1f} s, {direct2:.1f} s "
                  f"({direct_rate:.1f} requests/s); batch/one-by-one {batch_rate / direct_rate:.2f}")
            print(f"4. Redis: the batch's own keys {kept / args.run_lines:.0f} and {kept2 / args.run_lines:.0f} bytes "
                  f"a line once ended; at most {max(peak, peak2)} lines pending (unended jobs) at once")
            rss.append(memory_mib(api_pid, "VmRSS"))
            alone = interactive_p50(api, args.interactive)
            _upload_s, _create_s, running = accept(api, big)
            while api.get(f"/v1/batches/{running}").json()["request_counts"]["completed"] < 50:
                time.sleep(0.2)  # the batch's jobs fill the AR worker
            during = interactive_p50(api, args.interactive)
            done_meanwhile = api.get(f"/v1/batches/{running}").json()["request_counts"]["completed"]
            api.post(f"/v1/batches/{running}/cancel").raise_for_status()
            alone2 = interactive_p50(api, args.interactive) if wait_ended(api, running) else alone
            base = (alone + alone2) / 2
            print(f"5. interactive chat p50, one at a time: alone {alone * 1000:.0f} / {alone2 * 1000:.0f} ms, while the "
                  f"{args.lines:,}-line batch ran ({done_meanwhile} of its lines done by then) {during * 1000:.0f} ms: "
                  f"{during / base:.2f}x (target 1.5x)")
            print(f"6. API RSS (MiB): start {rss[0]:.1f}, after each upload "
                  f"{', '.join(f'{r:.1f}' for r in rss[1:-1])}, at the end {rss[-1]:.1f} "
                  f"(last/first upload {rss[-2] / rss[1]:.3f})")
    finally:
        system.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
