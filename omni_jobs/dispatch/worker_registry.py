"""Live workers, by queue: each worker keeps its entry in one Redis hash fresh while it can take tasks.

Readiness checks (the API's /readyz, the embedded launcher) read it to know that every queue has
someone listening, without talking to the broker's control channel; the scheduler reads how many
tasks the live workers of a queue run at once (its release window). One HGETALL reads every
worker, whatever the size of the keyspace; an entry whose worker stopped refreshing it is ignored
once it expires, and removed by the next reader.

A node name (``-n dit@%h``) belongs to one live process at a time (``claim_node``): a worker that
starts takes back what the earlier processes of its name held (omni_jobs.dispatch.leases), so a second live
worker of the same name would take the first's running steps.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import redis

from omni_jobs.core import keys
from omni_jobs.core.redis_replies import text_hash

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


@dataclass(frozen=True)
class NodeClaim:
    """This process's hold on its node name: the value it wrote (renewed while it is the value)."""

    name: str
    value: str


_RENEW = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] or held == false then return redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) end
return false
"""
"""Renew this process's claim; also take it again where it was lost (a Redis restarted without it)."""
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) end
return false
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _alive(pid: int) -> bool:
    """Whether a process of this host runs with ``pid``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True


def claim_node(client: redis.Redis, name: str) -> NodeClaim | str:
    """Hold ``name`` for this process, or say why not: another live process holds it.

    Held means a key with this process's host, pid and a token, which the heartbeat renews
    (HEARTBEAT_TTL_S). A holder on this host whose pid is gone (killed, then restarted under the
    same name: what a supervisor does) or is this very pid (a container restarted, numbering its
    processes again) is dead, and the name is taken over at once; one on another host is alive while
    its claim is fresh, so a name moved to another host waits for the claim to lapse."""
    host, pid = socket.gethostname(), os.getpid()
    value = json.dumps({"host": host, "pid": pid, "token": secrets.token_hex(8)})
    key = keys.worker_node(name)
    for _ in range(3):
        if client.set(key, value, nx=True, ex=HEARTBEAT_TTL_S):
            return NodeClaim(name, value)
        raw = client.get(key)
        if raw is None:
            continue  # lapsed meanwhile: try again
        held = raw.decode() if isinstance(raw, bytes) else str(raw)
        try:
            holder = json.loads(held)
            other_host, other_pid = str(holder["host"]), int(holder["pid"])
        except (ValueError, KeyError, TypeError):
            other_host, other_pid = "", 0
        same_host = other_host == host
        if (same_host and other_pid != pid and _alive(other_pid)) or (not same_host and other_host):
            where = "on this host" if same_host else f"on host {other_host}"
            return (f"another worker named {name} is running (pid {other_pid} {where}); a worker takes back what "
                    f"earlier processes of its name held, so two live ones would take each other's running steps: "
                    f"give each its own name (celery ... worker -n <queue>-2@%h), or stop the other first")
        if client.eval(_TAKE_OVER, 1, key, held, value, HEARTBEAT_TTL_S):
            return NodeClaim(name, value)
    return f"could not claim the worker name {name}: it changed hands three times while this worker started"


def release_node(client: redis.Redis, claim: NodeClaim) -> None:
    """Give the name back (a graceful stop: its next process need not wait for anything)."""
    client.eval(_RELEASE, 1, keys.worker_node(claim.name), claim.value)


def register_worker(client: redis.Redis, name: str, queues: list[str], concurrency: int = 1, cpus: str = "") -> None:
    payload = json.dumps({"name": name, "queues": sorted(queues), "concurrency": concurrency, "pid": os.getpid(),
                          "expires_at": time.time() + HEARTBEAT_TTL_S, "cpus": cpus})
    client.hset(keys.WORKERS, name, payload)


def unregister_worker(client: redis.Redis, name: str) -> None:
    client.hdel(keys.WORKERS, name)


def start_heartbeat(client: redis.Redis, name: str, queues: list[str], concurrency: int = 1,
                    cpus: str = "", claim: NodeClaim | None = None) -> threading.Event:
    """Refresh the worker's entry (and its claim on its name) from a daemon thread; set the returned
    event to stop."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_EVERY_S):
            try:
                register_worker(client, name, queues, concurrency, cpus)
                if claim is not None:
                    client.eval(_RENEW, 1, keys.worker_node(name), claim.value, HEARTBEAT_TTL_S)
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
