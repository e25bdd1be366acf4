"""How fast the API accepts jobs, against the bare stack it is built on, side by side.

    python -m bench.submit [--duration 10] [--reps 3] [--connections 16] [--rows idle,busy,durable,waitaof]

Two arms, each a uvicorn process, loaded by ``wrk`` (POST, 16 keep-alive connections), taking
turns per repetition so that both see the same machine:

- ``bare``: FastAPI + redis.asyncio with the same body as a pydantic model, one SET + one LPUSH in
  a MULTI (bench/bare_submit_app.py): the stack's own speed;
- ``system``: POST /v1/jobs of the real API (api.main:app), auth on with a real API key, a
  text-to-text job with a fresh prompt each time.

``--compare base=/tmp/base`` adds the API of another checkout as one more arm (measure a change
A/B in one run: ``git archive HEAD~1 | tar -x -C /tmp/base``).

Rows (each with a fresh redis-server that both arms write to):

- ``idle``: no Redis persistence, no workers: the submit path alone;
- ``busy``: 1,000 jobs queued first, then the ar and results workers running (on this machine's
  CPUs too) while the arms run;
- ``durable``: Redis AOF ``appendfsync always`` (the setting a durable 202 relies on, see
  bench/durability.py and docs/reliability.md), no workers;
- ``waitaof``: the other durable 202: a server with WAITAOF (Valkey, or Redis >= 7.2) on AOF
  ``everysec``, and each submit waits for its own fsync (OMNI_REDIS_WAIT_AOF; the bare arm sends
  WAITAOF after its MULTI), no workers.

Prints jobs/s (median of the repetitions), p50/p99 latency (median of the repetitions' wrk
percentiles), the server process's and redis-server's CPU time per request (medians), and the
ratios to bare. On a
shared machine jobs/s swings with the neighbours' load; CPU per request barely does: compare that
first. Needs ``wrk`` (apt-get install wrk).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from bench.procfs import cpu_s
from omni_jobs.accept.auth import ApiKeys
from omni_jobs.core import keys
from omni_jobs.local.devservices import (
    RunningService,
    exit_on_sigterm,
    free_port,
    require_waitaof_server,
    start_redis,
)

REPO = Path(__file__).resolve().parents[1]
ROWS = {"idle": "idle (no persistence, workers stopped)",
        "busy": "1,000 queued, workers running",
        "durable": "AOF always, workers stopped",
        "waitaof": "AOF everysec + WAITAOF, workers stopped"}

_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
%(auth)s
local n = 0
local tag = tostring(math.random(1, 1000000000))
request = function()
  n = n + 1
  return wrk.format(nil, "/v1/jobs", nil,
    '{"pipeline":"text-to-text","input":{"prompt":"bench ' .. tag .. ' ' .. n .. '"}}')
end
"""


@dataclass
class Arm:
    rates: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    """CPU time of the server process per request (user + system): what a request costs, which a
    busy shared machine changes far less than it changes jobs/s."""
    redis_cpu_ms: list[float] = field(default_factory=list)
    """CPU time of redis-server per request: on a machine this small it competes with the server."""
    errors: int = 0

    def row(self) -> tuple[float, float, float, float]:
        return (statistics.median(self.rates), statistics.median(self.p50_ms), statistics.median(self.p99_ms),
                statistics.median(self.cpu_ms))


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


def wrk(url: str, script: Path, *, connections: int, duration_s: float,
        threads: int = 2) -> tuple[float, float, float, int, int]:
    """(requests/s, p50 ms, p99 ms, non-2xx answers + socket errors, requests) of one wrk run."""
    out = subprocess.run(["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{duration_s:g}s",
                          "--timeout", "10s", "--latency", "-s", str(script), url],
                         check=True, capture_output=True, text=True).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    pct = dict(re.findall(r"^\s+(\d+)%\s+([\d.]+\w+)\s*$", out, re.MULTILINE))
    errors = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    errors += sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    return rate, _ms(pct["50"]), _ms(pct["99"]), errors, requests


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def start_uvicorn(name: str, app: str, env: dict[str, str], home: Path, source: Path = REPO) -> RunningService:
    """``source``: the checkout to run (another one for an A/B arm: ``--compare``)."""
    port = free_port()
    service = RunningService(name, [sys.executable, "-m", "uvicorn", app, "--port", str(port), "--log-level",
                                    "warning", "--no-access-log"], port, f"http://127.0.0.1:{port}",
                             lambda: _ready(port), log_path=home / f"{name}-{port}.log", start_timeout_s=60,
                             cwd=source, env={**os.environ, **env, "PYTHONPATH": str(source)})
    return service.start()


def start_worker(queue: str, pool: str, concurrency: int, env: dict[str, str], home: Path) -> RunningService:
    argv = [sys.executable, "-m", "celery", "-A", "workers.app:app", "worker", "-Q", queue, "-P", pool,
            "-c", str(concurrency), "-n", f"{queue}@bench", "--loglevel", "WARNING"]
    service = RunningService(f"worker-{queue}", argv, 0, queue, lambda: True, log_path=home / f"worker-{queue}.log",
                             start_timeout_s=60, cwd=REPO, env={**os.environ, **env})
    return service.start()


def system_env(redis_url: str, home: Path) -> dict[str, str]:
    return {"OMNI_REDIS_URL": redis_url, "OMNI_AUTH_ENABLED": "true", "OMNI_LOG_LEVEL": "WARNING",
            "OMNI_MAX_QUEUED_PER_QUEUE": "10000000", "OMNI_ARTIFACTS_DIR": str(home / "artifacts"),
            "OMNI_MODELS_DIR": os.environ.get("OMNI_MODELS_DIR", str(REPO / "var" / "models"))}


def measure_row(row: str, args: argparse.Namespace, home: Path) -> dict[str, Arm]:
    home.mkdir(parents=True, exist_ok=True)
    arms = {"bare": Arm(), "system": Arm(), **{name: Arm() for name in args.compare}}
    with ExitStack() as stack:
        waitaof = row == "waitaof"
        binary = require_waitaof_server() if waitaof else None
        server = stack.enter_context(start_redis(data_dir=home / "redis", appendonly=row in ("durable", "waitaof"),
                                                 appendfsync="always" if row == "durable" else "everysec",
                                                 binary=binary, waitaof=waitaof))
        key, _info = ApiKeys(redis.Redis.from_url(server.url)).create("bench", "bench.submit")
        env = {**system_env(server.url, home), **({"OMNI_REDIS_WAIT_AOF": "true"} if waitaof else {})}
        system = start_uvicorn("api", "api.main:app", env, home)
        stack.callback(system.stop)
        bare = start_uvicorn("bare", "bench.bare_submit_app:app",
                             {"BARE_REDIS_URL": server.url, "BARE_WAIT_AOF": "1" if waitaof else "0"}, home)
        stack.callback(bare.stop)
        urls = {"bare": bare.url, "system": system.url}
        pids = {"bare": _pid(bare), "system": _pid(system)}
        for name, source in args.compare.items():
            other = start_uvicorn(name, "api.main:app", env, home, source=source)
            stack.callback(other.stop)
            urls[name], pids[name] = other.url, _pid(other)
        scripts = {name: home / f"{name}.lua" for name in urls}
        for name, script in scripts.items():
            auth = "" if name == "bare" else f'wrk.headers["Authorization"] = "Bearer {key}"'
            script.write_text(_LUA % {"auth": auth})
        if row == "busy":
            with httpx.Client(base_url=system.url, headers={"authorization": f"Bearer {key}"}, timeout=30) as http:
                for i in range(1000):
                    r = http.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": f"queued {i}"}})
                    r.raise_for_status()
            for queue, pool, conc in (("ar", "threads", 16), ("results", "solo", 1)):
                stack.callback(start_worker(queue, pool, conc, env, home).stop)
            _wait_running(server.url, timeout_s=300)
        for name, url in urls.items():  # warm up: connections, scripts, imports
            wrk(url, scripts[name], connections=args.connections, duration_s=args.warmup)
        for _rep in range(args.reps):
            for name, url in urls.items():
                cpu_before, redis_before = cpu_s(pids[name]), cpu_s(_pid(server))
                rate, p50, p99, errors, requests = wrk(url, scripts[name], connections=args.connections,
                                                       duration_s=args.duration)
                cpu_ms = 1000 * (cpu_s(pids[name]) - cpu_before) / max(1, requests)
                redis_ms = 1000 * (cpu_s(_pid(server)) - redis_before) / max(1, requests)
                arm = arms[name]
                arm.rates.append(rate)
                arm.p50_ms.append(p50)
                arm.p99_ms.append(p99)
                arm.cpu_ms.append(cpu_ms)
                arm.redis_cpu_ms.append(redis_ms)
                arm.errors += errors
                print(f"  {row} {name}: {rate:,.0f} jobs/s, p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
                      f"{cpu_ms:.2f} CPU ms/request, Redis {redis_ms:.2f}" + (f", {errors} errors" if errors else ""),
                      flush=True)
    return arms


def _pid(service: RunningService) -> int:
    if service.pid is None:
        raise RuntimeError(f"{service.name} is not running")
    return service.pid


def _wait_running(redis_url: str, timeout_s: float) -> None:
    """Until the workers started some of the queued jobs (their engines loaded)."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.zcard(keys.queue_running("ar")) > 0 or client.zcard(keys.jobs_by_status("succeeded")) > 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the workers started no job within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # a kill stops what it started (the finally blocks, atexit)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per arm and repetition")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--rows", default="idle,busy,durable,waitaof", help=f"comma-separated, of {sorted(ROWS)}")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=DIR",
                        help="one more system arm: the API of another checkout (A/B of a change)")
    args = parser.parse_args(argv)
    args.compare = {n: Path(d).resolve() for n, d in (c.split("=", 1) for c in args.compare)}
    if shutil.which("wrk") is None:
        parser.error("needs wrk on PATH (apt-get install wrk)")
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    results: dict[str, dict[str, Arm]] = {}
    with tempfile.TemporaryDirectory(prefix="omni-bench-submit-") as tmp:
        for row in rows:
            print(f"measuring: {ROWS[row]} ...", flush=True)
            results[row] = measure_row(row, args, Path(tmp) / row)
    print(f"\nPOST /v1/jobs, {args.connections} connections, {args.reps} x {args.duration:g} s per arm, medians\n")
    print("| row | arm | jobs/s | p50 ms | p99 ms | server CPU ms/job | Redis CPU ms/job | jobs/s vs bare "
          "| CPU/job vs bare |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row, arms in results.items():
        bare_rate, _, _, bare_cpu = arms["bare"].row()
        for name, arm in arms.items():
            rate, p50, p99, cpu = arm.row()
            ratios = f"{rate / bare_rate:.2f} | {cpu / bare_cpu:.1f}x" if name != "bare" else " | "
            errs = f" ({arm.errors} errors)" if arm.errors else ""
            redis_ms = statistics.median(arm.redis_cpu_ms)
            print(f"| {ROWS[row]} | {name}{errs} | {rate:,.0f} | {p50:.1f} | {p99:.1f} | {cpu:.2f} | {redis_ms:.2f} "
                  f"| {ratios} |")
    if args.json:
        args.json.write_text(json.dumps({row: {name: vars(arm) for name, arm in arms.items()}
                                         for row, arms in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
