"""Live workers, by queue: each worker keeps its entry in one Redis hash fresh while it can take tasks.

Readiness checks (the API's /readyz, the embedded launcher) read it to know that every queue has
someone listening, without talking to the broker's control channel; the scheduler reads how many
tasks the live workers of a queue run at once (its release window). One HGETALL reads every
worker, whatever the size of the keyspace; an entry whose worker stopped refreshing it is ignored
once it expires, and removed by the next reader.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import redis

from omni_jobs import keys
from omni_jobs.redis_replies import text_hash

HEARTBEAT_TTL_S = 30
HEARTBEAT_EVERY_S = 10


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    queues: tuple[str, ...]
    concurrency: int
    pid: int
    expires_at: float
    cpus: str = ""
    """The CPUs its engines run on (OMNI_ENGINE_CPUS); empty: every CPU."""


def register_worker(client: redis.Redis, name: str, queues: list[str], concurrency: int = 1, cpus: str = "") -> None:
    payload = json.dumps({"name": name, "queues": sorted(queues), "concurrency": concurrency, "pid": os.getpid(),
                          "expires_at": time.time() + HEARTBEAT_TTL_S, "cpus": cpus})
    client.hset(keys.WORKERS, name, payload)


def unregister_worker(client: redis.Redis, name: str) -> None:
    client.hdel(keys.WORKERS, name)


def start_heartbeat(client: redis.Redis, name: str, queues: list[str], concurrency: int = 1,
                    cpus: str = "") -> threading.Event:
    """Refresh the worker's entry from a daemon thread; set the returned event to stop."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_EVERY_S):
            try:
                register_worker(client, name, queues, concurrency, cpus)
            except redis.RedisError:
                continue

    register_worker(client, name, queues, concurrency, cpus)
    threading.Thread(target=beat, name="omni-heartbeat", daemon=True).start()
    return stop


def workers(client: redis.Redis) -> list[WorkerInfo]:
    """The live workers (expired entries are dropped from the hash on the way)."""
    now = time.time()
    live: list[WorkerInfo] = []
    expired: list[str] = []
    for name, payload in text_hash(client.hgetall(keys.WORKERS)).items():
        info = json.loads(payload)
        if float(info.get("expires_at", 0)) < now:
            expired.append(name)
            continue
        live.append(WorkerInfo(info["name"], tuple(info["queues"]), int(info.get("concurrency", 1)),
                               int(info.get("pid", 0)), float(info["expires_at"]), str(info.get("cpus", ""))))
    if expired:
        client.hdel(keys.WORKERS, *expired)
    return live


def live_workers(client: redis.Redis) -> dict[str, list[str]]:
    """Queue name -> names of the workers listening on it now."""
    by_queue: dict[str, list[str]] = defaultdict(list)
    for info in workers(client):
        for queue in info.queues:
            by_queue[queue].append(info.name)
    return dict(by_queue)


def queue_capacity(client: redis.Redis) -> dict[str, int]:
    """Queue name -> how many tasks its live workers run at once, all together."""
    capacity: dict[str, int] = defaultdict(int)
    for info in workers(client):
        for queue in info.queues:
            capacity[queue] += info.concurrency
    return dict(capacity)
