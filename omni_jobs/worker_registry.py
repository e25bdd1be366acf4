"""Live workers, by queue: each worker keeps a heartbeat key in Redis while it can take tasks.

Readiness checks (the API's /readyz, the embedded launcher) read it to know that every queue has
someone listening, without talking to the broker's control channel.
"""

from __future__ import annotations

import json
import os
import threading
from collections import defaultdict

import redis

from omni_jobs import keys

HEARTBEAT_TTL_S = 30
HEARTBEAT_EVERY_S = 10


def register_worker(client: redis.Redis, name: str, queues: list[str]) -> None:
    payload = json.dumps({"name": name, "queues": sorted(queues), "pid": os.getpid()})
    client.set(keys.worker(name), payload, ex=HEARTBEAT_TTL_S)


def unregister_worker(client: redis.Redis, name: str) -> None:
    client.delete(keys.worker(name))


def start_heartbeat(client: redis.Redis, name: str, queues: list[str]) -> threading.Event:
    """Refresh the worker's key from a daemon thread; set the returned event to stop."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_EVERY_S):
            try:
                register_worker(client, name, queues)
            except redis.RedisError:
                continue

    register_worker(client, name, queues)
    threading.Thread(target=beat, name="omni-heartbeat", daemon=True).start()
    return stop


def live_workers(client: redis.Redis) -> dict[str, list[str]]:
    """Queue name -> names of the workers listening on it now."""
    by_queue: dict[str, list[str]] = defaultdict(list)
    for key in client.scan_iter(match=keys.WORKER_PATTERN, count=100):
        raw = client.get(key)
        if raw is None:
            continue
        info = json.loads(raw)
        for queue in info["queues"]:
            by_queue[queue].append(info["name"])
    return dict(by_queue)
