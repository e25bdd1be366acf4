"""A Redis primary, its replicas and three Sentinels as child processes: ``omni-jobs up --replicas N``,
and the failover tests.

Every process of the system is given the Sentinels' URL (``sentinel://.../omni/0``), never a server's
address, so that they all follow the primary when the Sentinels fail over to a replica. A data
server that this module starts again (the supervisor, after a crash) asks the Sentinels first: where
they name another primary, it comes back as that one's replica. Started as it was, the old primary
would take writes from its own AOF until the Sentinels demote it, and those writes would be lost.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from omni_jobs.local.devservices import RunningService, ServiceError, _find_binary, free_port, start_redis

MASTER_NAME = "omni"
DOWN_AFTER_MS = 2000
"""How long the Sentinels wait on a silent primary before they agree it is down and promote a replica
(Sentinel's default is 30 s; omni_jobs.core.redis_clients retries for FAILOVER_RETRY_S)."""
FAILOVER_TIMEOUT_MS = 10000
SENTINEL_INSTALL_HINT = ("no Sentinel binary found: install valkey-server (it runs as a Sentinel with "
                         "--sentinel; scripts/bootstrap installs it) or redis-server")


def find_sentinel_binary() -> str:
    """A server binary that runs as a Sentinel (``--sentinel``): valkey-sentinel, redis-sentinel, or the
    servers themselves (the same program)."""
    for name in ("valkey-sentinel", "redis-sentinel", "valkey-server", "redis-server"):
        found = _find_binary(name)
        if found is not None:
            return found
    raise ServiceError(SENTINEL_INSTALL_HINT)


def _client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5,
                       decode_responses=True, retry=Retry(NoBackoff(), 0))


def _ping(port: int) -> bool:
    try:
        with _client(port) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def _sentinel_replicas(port: int, master: str) -> list[object]:
    with _client(port) as client:
        return list(client.execute_command("SENTINEL", "replicas", master))


def sentinel_primary(sentinel_ports: Sequence[int], master: str = MASTER_NAME) -> int | None:
    """The primary's port as the first Sentinel that answers names it (None if none answers)."""
    for port in sentinel_ports:
        try:
            with _client(port) as client:
                reply = client.execute_command("SENTINEL", "get-master-addr-by-name", master)
        except redis.RedisError:
            continue
        if reply and len(reply) == 2:
            return int(reply[1])
    return None


def write_sentinel_config(path: Path, *, port: int, primary_port: int, master: str = MASTER_NAME,
                          quorum: int = 2, down_after_ms: int = DOWN_AFTER_MS) -> Path:
    """A Sentinel's config file (it rewrites the file itself as it learns: keep one per Sentinel)."""
    path.write_text(f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {path.parent}\n"
                    f"sentinel monitor {master} 127.0.0.1 {primary_port} {quorum}\n"
                    f"sentinel down-after-milliseconds {master} {down_after_ms}\n"
                    f"sentinel failover-timeout {master} {FAILOVER_TIMEOUT_MS}\n"
                    f"sentinel parallel-syncs {master} 1\n")
    return path


class DataNode(RunningService):
    """A Redis data server of the set. Started again, it asks the Sentinels where the primary is and,
    where that is another server, starts as its replica (see the module's docstring)."""

    sentinel_ports: tuple[int, ...] = ()
    """The set's Sentinels (empty until they run: the node starts as first configured)."""
    first_primary: int | None = None
    """The primary it replicated when the set started (None: it was the primary)."""

    def start(self) -> RunningService:
        primary = sentinel_primary(self.sentinel_ports) if self.sentinel_ports else None
        if primary is None:
            primary = self.first_primary
        argv = list(self.argv)
        if "--replicaof" in argv:
            at = argv.index("--replicaof")
            del argv[at:at + 3]
        if primary is not None and primary != self.port:
            argv += ["--replicaof", "127.0.0.1", str(primary)]
        self.argv = argv
        return super().start()


@dataclass
class RedisHA:
    """A primary, its replicas and Sentinels; ``url`` is what every process is given."""

    nodes: list[DataNode]
    sentinels: list[RunningService]
    master: str = MASTER_NAME
    started_primary: int = 0
    said: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"sentinel://{hosts}/{self.master}/0"

    @property
    def sentinel_ports(self) -> list[int]:
        return [s.port for s in self.sentinels]

    def primary_port(self) -> int | None:
        """Where the Sentinels say the primary is now."""
        return sentinel_primary(self.sentinel_ports, self.master)

    def primary(self) -> DataNode:
        """The data server the Sentinels name as primary."""
        port = self.primary_port()
        found = next((n for n in self.nodes if n.port == port), None)
        if found is None:
            raise ServiceError(f"the Sentinels name no primary of this set (they say port {port})")
        return found

    def wait_for_failover(self, old_port: int, timeout_s: float = 30.0) -> float:
        """Seconds until the Sentinels name a primary other than ``old_port`` (TimeoutError past ``timeout_s``)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            port = self.primary_port()
            if port is not None and port != old_port and _ping(port):
                return time.monotonic() - start
            time.sleep(0.05)
        raise TimeoutError(f"the Sentinels named no new primary within {timeout_s:.0f} s")

    def wait_replicated(self, timeout_s: float = 30.0) -> None:
        """Until the primary has all its replicas online and the Sentinels know them (a failover then has
        somewhere to go)."""
        deadline = time.monotonic() + timeout_s
        want = len(self.nodes) - 1
        while time.monotonic() < deadline:
            port = self.primary_port()
            try:
                with _client(port or 0) as primary:
                    info = primary.info("replication")
                known = [len(_sentinel_replicas(p, self.master)) for p in self.sentinel_ports]
            except redis.RedisError:
                time.sleep(0.1)
                continue
            online = sum(isinstance(v, dict) and v.get("state") == "online"
                         for k, v in info.items() if k.startswith("slave"))
            if online >= want and min(known) >= want:
                return
            time.sleep(0.1)
        raise TimeoutError(f"the replicas did not come online within {timeout_s:.0f} s")

    @property
    def processes(self) -> list[RunningService]:
        return [*self.nodes, *self.sentinels]

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop(timeout_s=5)


def start_redis_ha(data_dir: Path, *, replicas: int = 1, sentinels: int = 3, appendfsync: str = "always",
                   binary: str | None = None, waitaof: bool = False, down_after_ms: int = DOWN_AFTER_MS,
                   master: str = MASTER_NAME) -> RedisHA:
    """A primary with AOF (``appendfsync``), ``replicas`` replicas of it and ``sentinels`` Sentinels
    (quorum: a majority), each on a free port under ``data_dir``; returns once the replicas are in sync
    and the Sentinels know them."""
    if replicas < 1:
        raise ValueError("a failover needs at least one replica")
    nodes: list[DataNode] = []
    sentinel_services: list[RunningService] = []
    ha = RedisHA(nodes, sentinel_services, master)
    try:
        for i in range(1 + replicas):
            primary_port = nodes[0].port if nodes else None
            # start_redis finds a free port and spells the server's arguments; the node takes them over
            service = start_redis(data_dir=data_dir / f"node-{i}", appendonly=True, appendfsync=appendfsync,
                                  replica_of=primary_port, binary=binary, waitaof=waitaof)
            service.stop()
            node = DataNode(f"redis-{i}", service.argv, service.port, service.url, partial(_ping, service.port),
                            log_path=service.log_path, start_timeout_s=10.0, cwd=data_dir / f"node-{i}")
            node.first_primary = primary_port
            nodes.append(node)
            node.start()
        ha.started_primary = nodes[0].port
        sentinel_binary = find_sentinel_binary()
        quorum = sentinels // 2 + 1
        for i in range(sentinels):
            directory = data_dir / f"sentinel-{i}"
            directory.mkdir(parents=True, exist_ok=True)
            port = free_port()
            config = write_sentinel_config(directory / "sentinel.conf", port=port, primary_port=nodes[0].port,
                                           master=master, quorum=quorum, down_after_ms=down_after_ms)
            sentinel = RunningService(f"sentinel-{i}", [sentinel_binary, str(config), "--sentinel"], port,
                                      f"sentinel://127.0.0.1:{port}", partial(_ping, port),
                                      log_path=directory / "sentinel.log", start_timeout_s=10.0, cwd=directory)
            sentinel_services.append(sentinel.start())
        for node in nodes:
            node.sentinel_ports = tuple(ha.sentinel_ports)
        ha.wait_replicated()
    except BaseException:
        ha.stop()
        raise
    return ha
