"""The failover run: SIGKILL the Redis primary with hundreds of jobs in flight, under Sentinels.

    python -m tests.fault.failover [--jobs 240] [--kill-at 200] [--wait-replicas 1] [--seed 7]

It starts the system as ``omni-jobs up --replicas 1`` does: a primary and a replica (AOF, as
``omni-jobs up`` keeps them), 3 Sentinels, and every process given the Sentinels' URL. Clients
submit jobs (text-to-image and text-to-text, every one with a webhook, each with an Idempotency-Key
and retried on a connection error or a 503 as a careful client would). Once ``kill_at`` jobs have
been answered 202, while the rest are still being submitted, it SIGKILLs the primary. The
supervisor keeps it down until the Sentinels have promoted the replica, then starts it again, as
the new primary's replica (omni_jobs.local.ha.DataNode). Then it counts as the chaos run does
(tests/fault/chaos.py): jobs answered 202 and then missing, unfinished, duplicated engine runs,
duplicated or missing webhooks, duplicated output files, and the time from the kill to the last
job's end.

With ``--wait-replicas 1`` (OMNI_REDIS_WAIT_REPLICAS) it exits 1 unless nothing is lost or
duplicated and every job is done within 60 s of the failover. With 0 it reports what was lost.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from omni_jobs.core.settings import Settings
from omni_jobs.local.devservices import free_port
from omni_jobs.local.embedded import EmbeddedSystem
from omni_jobs.local.ha import RedisHA
from tests.fault.chaos import (
    DONE_WITHIN_S,
    WEBHOOK_EVENTS,
    WEBHOOKS_WITHIN_S,
    ChaosResult,
    Fault,
    _client_submit,
    _count_effects,
    _explain_missing_webhooks,
    _wait_all,
    _wait_webhooks,
    start_supervisor,
)
from tests.fault.lag_proxy import LagProxy
from tests.webhook_receiver import WebhookReceiver

REPO = Path(__file__).resolve().parents[2]
FROZEN_S = 30.0
WORKER_QUEUES = {"ar": "threads", "dit": "threads", "results": "solo", "webhooks": "threads"}
"""The queues of the jobs it submits (text-to-image, text-to-text): no speech engines to load."""


@dataclass
class FailoverResult(ChaosResult):
    wait_replicas: int = 1
    replica_lag_ms: int = 0
    in_flight_at_kill: int = 0
    failover_s: float = 0.0
    """From the SIGKILL to the Sentinels naming a new primary that answers."""
    first_202_after_kill_s: float | None = None
    """From the SIGKILL to the first submit answered 202 after it."""

    @property
    def ok(self) -> bool:
        return super().ok and self.in_flight_at_kill >= 1

    def table(self) -> str:
        extra = [
            f"| OMNI_REDIS_WAIT_REPLICAS | {self.wait_replicas} |",
            f"| replication lag (the primary's machine lost with it) | {self.replica_lag_ms} ms |",
            f"| jobs in flight at the kill (202, not done) | {self.in_flight_at_kill} |",
            f"| failover (kill -> Sentinels name the replica) | {self.failover_s:.1f} s |",
            "| first 202 after the kill | "
            + (f"{self.first_202_after_kill_s:.1f} s |" if self.first_202_after_kill_s is not None else "none |"),
        ]
        lines = super().table().splitlines()
        return "\n".join(lines[:2] + extra + lines[2:])


def run(jobs: int = 240, kill_at: int = 200, wait_replicas: int = 1, seed: int = 7, home: Path | None = None,
        say: Any = print, image_share: float = 0.4, replica_lag_ms: int = 0, freeze: bool = False) -> FailoverResult:
    """``replica_lag_ms``: the replica replicates through a LagProxy (tests/fault/lag_proxy.py) and the
    kill drops what is on its way too: the loss of the primary's machine with that replication lag.
    ``freeze``: SIGSTOP the primary instead (its port takes a TCP handshake and answers nothing, as a
    machine that is gone or cut off), and SIGKILL it only ``FROZEN_S`` after the Sentinels promoted the
    replica: until then no connection to it is reset, and every process must have left it by itself."""
    rng = random.Random(seed)
    home = (home or REPO / "var" / "failover").resolve()
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    journal = home / "engine-runs.jsonl"
    settings = Settings(models_dir=REPO / "var" / "models", artifacts_dir=home / "artifacts")
    result = FailoverResult(wait_replicas=wait_replicas, replica_lag_ms=replica_lag_ms)
    lock = threading.Lock()
    accepted_at: dict[str, float] = {}
    killed = threading.Event()
    with WebhookReceiver() as receiver:
        hook = receiver.script("/chaos", [])
        system = EmbeddedSystem(settings=settings, home=home, api_port=free_port(), with_flower=False,
                                redis_replicas=1, worker_queues=dict(WORKER_QUEUES),
                                extra_env={"OMNI_RUN_JOURNAL": str(journal),
                                           "OMNI_WEBHOOK_ALLOW_HOSTS": '["127.0.0.1"]',
                                           "OMNI_REDIS_WAIT_REPLICAS": str(wait_replicas)})
        system.start(say=lambda m: say(f"  [system] {m}"))
        ha = system.redis_ha
        assert ha is not None
        held_down: set[str] = set()
        stop = threading.Event()
        lag = _lag_replica(ha, replica_lag_ms / 1000) if replica_lag_ms else None

        start_supervisor(system, held_down, stop, say, name="failover-supervisor")
        api = httpx.Client(base_url=system.api_url, timeout=30,
                           headers={"authorization": f"Bearer {system.api_key}"} if system.api_key else {})
        kill_time: list[float] = []
        try:
            def chaos_monkey() -> None:
                while not stop.is_set():
                    with lock:
                        if len(result.accepted) >= kill_at:
                            break
                    time.sleep(0.01)
                primary = ha.primary()
                held_down.add(primary.name)
                say(f"  [failover] SIGKILL the primary ({primary.name}, port {primary.port}) "
                    f"with {len(result.accepted)} jobs answered 202")
                if lag is not None:
                    lag.cut()  # what was on its way to the replica dies with the primary's machine
                if freeze and primary.pid is not None:
                    os.kill(primary.pid, signal.SIGSTOP)
                else:
                    primary.kill()
                killed_at = time.monotonic()
                kill_time.append(time.time())
                killed.set()
                result.faults = [Fault(primary.name, killed_at - started)]
                result.failover_s = ha.wait_for_failover(primary.port)
                if freeze:
                    stop.wait(FROZEN_S)
                    primary.kill()  # SIGKILL ends a stopped process too
                say(f"  [failover] the Sentinels named port {ha.primary_port()} after {result.failover_s:.1f} s")
                held_down.discard(primary.name)  # the supervisor starts it, as the new primary's replica

            def one(i: int) -> None:
                kind = kinds[i]
                body: dict[str, Any] = {"pipeline": kind, "input": {"prompt": f"failover {i}"},
                                        "webhook": hook, "webhook_events_filter": list(WEBHOOK_EVENTS)}
                if kind == "text-to-image":
                    body["params"] = {"ar": {"max_tokens": 4}, "dit": {"height": 64, "width": 64,
                                                                       "num_inference_steps": 8, "seed": i}}
                else:
                    body["params"] = {"ar": {"max_tokens": 8, "seed": i}}
                job_id = _client_submit(api, body, result, lock)
                with lock:
                    result.accepted.append(job_id)
                    result.kinds[job_id] = kind
                    result.webhook_jobs.add(job_id)
                    accepted_at[job_id] = time.time()
                    if killed.is_set() and result.first_202_after_kill_s is None:
                        result.first_202_after_kill_s = time.time() - kill_time[0]

            kinds = [("text-to-image" if rng.random() < image_share else "text-to-text") for _ in range(jobs)]
            started = time.monotonic()
            monkey = threading.Thread(target=chaos_monkey, name="failover-monkey", daemon=True)
            monkey.start()
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(one, range(jobs)))
            monkey.join()
            last_fault = started + result.faults[0].at
            say(f"  [failover] all {len(result.accepted)} submitted; waiting for the jobs ...")
            _wait_all(api, result, deadline=last_fault + DONE_WITHIN_S + 60)
            ends = [j["completed_at"] for j in result.final.values() if j.get("completed_at")]
            result.last_done_after_last_fault_s = max(0.0, max(ends, default=0.0) - kill_time[0])
            result.in_flight_at_kill = sum(1 for job_id, at in accepted_at.items() if at <= kill_time[0]
                                           and not (result.final.get(job_id, {}).get("completed_at") or 1e18)
                                           < kill_time[0])
            _wait_webhooks(result, receiver, deadline=time.monotonic() + WEBHOOKS_WITHIN_S)
            time.sleep(3)  # late duplicates and journal lines land
            _count_effects(result, journal, receiver, settings.artifacts_dir)
            _explain_missing_webhooks(api, result)
            result.findings += [f"{job_id}: answered 202, then unknown (404)" for job_id in result.missing]
        finally:
            stop.set()
            api.close()
            if lag is not None:
                lag.cut()
            system.stop()
    return result


def _lag_replica(ha: RedisHA, lag_s: float) -> LagProxy:
    """Make the replica replicate through a LagProxy, and wait until its link is up again. Within the
    Sentinels' failover-timeout (10 s) they leave its odd-looking primary address alone."""
    primary, replica = ha.primary(), next(n for n in ha.nodes if n.port != ha.primary_port())
    proxy = LagProxy(primary.port, lag_s).__enter__()
    client = redis.Redis(port=replica.port, decode_responses=True)
    client.execute_command("REPLICAOF", "127.0.0.1", str(proxy.port))
    deadline = time.monotonic() + 20
    while client.info("replication").get("master_link_status") != "up":
        if time.monotonic() > deadline:
            raise TimeoutError("the replica did not link through the lag proxy")
        time.sleep(0.05)
    client.close()
    return proxy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=240)
    parser.add_argument("--kill-at", type=int, default=200, help="SIGKILL the primary once this many jobs got 202")
    parser.add_argument("--wait-replicas", type=int, default=1, help="OMNI_REDIS_WAIT_REPLICAS")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--freeze", action="store_true",
                        help="SIGSTOP the primary (answers nothing, as a machine gone) rather than SIGKILL it")
    parser.add_argument("--replica-lag-ms", type=int, default=0,
                        help="the replica this far behind, and the primary's whole machine lost at the kill")
    parser.add_argument("--home", type=Path, default=REPO / "var" / "failover")
    args = parser.parse_args(argv)
    result = run(args.jobs, args.kill_at, args.wait_replicas, args.seed, args.home,
                 replica_lag_ms=args.replica_lag_ms, freeze=args.freeze)
    print("\n" + result.table())
    if args.wait_replicas < 1:
        print(f"\nlost: {len(result.missing)} of {len(result.accepted)} jobs answered 202")
        return 0
    print("\nPASS" if result.ok else "\nFAIL")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
