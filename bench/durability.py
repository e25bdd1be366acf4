"""What a 202 that survives a crash costs: submissions/s for each Redis durability setting.

    python -m bench.durability [--jobs 600] [--reps 3] [--clients 16]

For each setting it starts a fresh redis-server (and a replica where the setting needs one) and
submits text-to-text jobs two ways, arms taking turns per repetition:

- ``ledger``: 16 threads calling the same atomic submit the API makes (JobLedger.submit): the
  store's own cost, where fsync shows;
- ``api``: 16 HTTP clients posting to a real API process (uvicorn, no workers), as users do.

Settings: no persistence (the floor: a crash loses everything), AOF ``everysec`` (a crash loses
up to a second of 202s), AOF ``always`` (fsync before each reply; Redis groups the fsyncs of
concurrent clients), AOF ``everysec`` with ``WAITAOF`` per submit (a 202 waits for its own fsync,
every other write for none; needs Valkey or Redis >= 7.2), and ``everysec`` plus a replica with
``WAIT 1`` per submit (a 202 is on two machines; a crash of one loses nothing). Prints median
submissions/s and p50/p99 latency, and ratios to ``always``. Absolute numbers are this machine's;
compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from omni_jobs.accept.submission import build_job, resolve_params
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.local.devservices import (
    RunningService,
    exit_on_sigterm,
    free_port,
    require_waitaof_server,
    start_redis,
)
from omni_jobs.pipelines.catalogue import load_catalogue

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mode:
    name: str
    appendonly: bool
    appendfsync: str = "everysec"
    replica: bool = False
    wait_aof: bool = False
    """Each submit waits for its own fsync (WAITAOF; a server that has it: Valkey, or Redis >= 7.2)."""


MODES = [
    Mode("no persistence", appendonly=False),
    Mode("AOF everysec", appendonly=True, appendfsync="everysec"),
    Mode("AOF always", appendonly=True, appendfsync="always"),
    Mode("AOF everysec + WAITAOF", appendonly=True, appendfsync="everysec", wait_aof=True),
    Mode("AOF everysec + replica, WAIT 1", appendonly=True, appendfsync="everysec", replica=True),
]


@dataclass
class Arm:
    rates: list[float] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)


def _run(n: int, clients: int, submit: Callable[[int], None]) -> tuple[float, list[float]]:
    latencies: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        started = time.perf_counter()
        submit(i)
        with lock:
            latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(n)))
    return n / (time.perf_counter() - started), latencies


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(mode: Mode, args: argparse.Namespace, home: Path) -> dict[str, Arm]:
    arms = {"ledger": Arm(), "api": Arm()}
    spec = load_catalogue().get("text-to-text")
    with ExitStack() as stack:
        binary = require_waitaof_server() if mode.wait_aof else None
        primary = stack.enter_context(start_redis(data_dir=home / "primary", appendonly=mode.appendonly,
                                                  appendfsync=mode.appendfsync, binary=binary,
                                                  waitaof=mode.wait_aof))
        wait = 0
        if mode.replica:
            stack.enter_context(start_redis(data_dir=home / "replica", appendonly=True, appendfsync=mode.appendfsync,
                                            replica_of=primary.port))
            client = redis.Redis.from_url(primary.url)
            deadline = time.monotonic() + 20
            while client.info("replication").get("slave0", {}).get("state") != "online":  # the first sync done
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica did not come online in 20 s")
                time.sleep(0.1)
            wait = 1
        store = RedisJobStore(redis.Redis.from_url(primary.url, max_connections=64), ttl_s=3600,
                              wait_replicas=wait, wait_timeout_ms=2000, wait_aof=mode.wait_aof)
        ledger = JobLedger(store)
        api = _start_api(primary.url, wait, home, mode.wait_aof)
        stack.callback(api.stop)
        http = httpx.Client(base_url=f"http://127.0.0.1:{api.port}", timeout=30,
                            limits=httpx.Limits(max_connections=args.clients))
        params = resolve_params(spec, {})

        def via_ledger(i: int) -> None:
            ledger.submit(build_job(spec, {"prompt": f"job {i}"}, params), ["ar"])

        def via_api(i: int) -> None:
            r = http.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": f"job {i}"}})
            if r.status_code != 202:
                raise RuntimeError(f"{r.status_code} {r.text}")

        _run(50, args.clients, via_ledger)  # warm up both paths (connections, scripts, imports)
        _run(50, args.clients, via_api)
        for _rep in range(args.reps):
            for name, submit in (("ledger", via_ledger), ("api", via_api)):
                rate, latencies = _run(args.jobs, args.clients, submit)
                arms[name].rates.append(rate)
                arms[name].latencies_ms.extend(latencies)
    return arms


def _start_api(redis_url: str, wait_replicas: int, home: Path, wait_aof: bool = False) -> RunningService:
    port = free_port()
    env = {**os.environ, "OMNI_REDIS_URL": redis_url, "OMNI_AUTH_ENABLED": "false", "OMNI_LOG_LEVEL": "WARNING",
           "OMNI_MAX_QUEUED_PER_QUEUE": "1000000", "OMNI_REDIS_WAIT_REPLICAS": str(wait_replicas),
           "OMNI_REDIS_WAIT_AOF": "true" if wait_aof else "false",
           "OMNI_ARTIFACTS_DIR": str(home / "artifacts")}

    def ready() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    api = RunningService("api", [sys.executable, "-m", "uvicorn", "api.main:app", "--port", str(port),
                                 "--log-level", "warning"], port, f"api:{port}", ready,
                         log_path=home / f"api-{port}.log", start_timeout_s=60, cwd=REPO, env=env)
    return api.start()


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # a kill stops what it started (the finally blocks, atexit)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=600, help="submissions per arm and repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, Arm]] = {}
    with tempfile.TemporaryDirectory(prefix="omni-durability-") as tmp:
        for i, mode in enumerate(MODES):
            print(f"measuring: {mode.name} ...", flush=True)
            results[mode.name] = measure(mode, args, Path(tmp) / str(i))
    base = {arm: statistics.median(results["AOF always"][arm].rates) for arm in ("ledger", "api")}
    print(f"\n{args.jobs} submissions x {args.reps} reps, {args.clients} concurrent clients, medians\n")
    print("| setting | ledger submits/s | p50 / p99 ms | x always | API submits/s | p50 / p99 ms | x always |")
    print("|---|---|---|---|---|---|---|")
    for name, arms in results.items():
        cells = []
        for arm in ("ledger", "api"):
            rate = statistics.median(arms[arm].rates)
            lat = arms[arm].latencies_ms
            cells += [f"{rate:,.0f}", f"{_percentile(lat, 0.5):.1f} / {_percentile(lat, 0.99):.1f}",
                      f"{rate / base[arm]:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({name: {arm: {"rates": a.rates, "p50_ms": _percentile(a.latencies_ms, 0.5),
                                                      "p99_ms": _percentile(a.latencies_ms, 0.99)}
                                                for arm, a in arms.items()} for name, arms in results.items()},
                                        indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
