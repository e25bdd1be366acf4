"""Sentinel URLs against real servers: a primary, a replica and 3 Sentinels, all over TLS
(``sentinels://...?ssl_ca_certs=``), as a managed Redis with TLS serves them.

The clients of omni_jobs.core.redis_clients (sync, asyncio, the bounded pool of the event streams) and
kombu's Sentinel transport (the broker, as celery_config spells it) each find the primary, and
follow it through a Sentinel failover, where the old primary turns replica and answers READONLY.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import redis
from kombu import Connection

from omni_jobs.core.redis_clients import async_client_from_url, redis_client
from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.queueing import celery_config
from omni_jobs.local.devservices import RunningService, find_waitaof_server, free_port
from omni_jobs.local.ha import find_sentinel_binary

pytestmark = pytest.mark.integration
MASTER = "omni"


@dataclass
class TlsSet:
    url: str
    ca: Path
    nodes: list[RunningService]
    sentinels: list[RunningService]

    def admin(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(self.ca), decode_responses=True)

    def primary_port(self) -> int:
        with self.admin(self.sentinels[0].port) as client:
            return int(client.execute_command("SENTINEL", "get-master-addr-by-name", MASTER)[1])


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for 127.0.0.1 (every server and Sentinel uses it)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=omni-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (directory / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "ext")
    return directory / "ca.crt", directory / "server.crt", directory / "server.key"


def _tls_ping(port: int, ca: Path, password: str | None = None) -> bool:
    try:
        with redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(ca), socket_timeout=0.5,
                         password=password) as c:
            return bool(c.ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="module")
def tls_set(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsSet]:
    binary = find_waitaof_server()
    if binary is None or "valkey" not in binary:
        pytest.skip("needs valkey-server (TLS built in): scripts/bootstrap installs it")
    home = tmp_path_factory.mktemp("sentinel-tls")
    ca, cert, key = _certificates(home)
    tls = ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
           "--tls-auth-clients", "no", "--tls-replication", "yes", "--port", "0"]
    started: list[RunningService] = []
    try:
        nodes: list[RunningService] = []
        for i in range(2):
            port = free_port()
            argv = [binary, "--bind", "127.0.0.1", "--tls-port", str(port), "--save", "", "--dir", str(home), *tls,
                    "--requirepass", "pw", "--masterauth", "pw"]
            if nodes:
                argv += ["--replicaof", "127.0.0.1", str(nodes[0].port)]
            node = RunningService(f"node-{i}", argv, port, "", partial(_tls_ping, port, ca, "pw"),
                                  log_path=home / f"node-{i}.log", start_timeout_s=10).start()
            nodes.append(node)
            started.append(node)
        sentinels: list[RunningService] = []
        for i in range(3):
            port = free_port()
            conf = home / f"sentinel-{i}.conf"
            conf.write_text(f"bind 127.0.0.1\ndir {home}\nsentinel monitor {MASTER} 127.0.0.1 {nodes[0].port} 2\n"
                            f"sentinel auth-pass {MASTER} pw\nsentinel down-after-milliseconds {MASTER} 2000\n"
                            f"sentinel failover-timeout {MASTER} 10000\n")
            sentinel = RunningService(f"sentinel-{i}", [find_sentinel_binary(), str(conf), "--sentinel", "--port", "0",
                                                        "--tls-port", str(port), *tls[:-2]], port, "",
                                      partial(_tls_ping, port, ca), log_path=home / f"sentinel-{i}.log",
                                      start_timeout_s=10).start()
            sentinels.append(sentinel)
            started.append(sentinel)
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in sentinels)
        yield TlsSet(f"sentinels://:pw@{hosts}/{MASTER}/0?ssl_ca_certs={ca}", ca, nodes, sentinels)
    finally:
        for service in reversed(started):
            service.stop(timeout_s=5)


def _wait_replica_known(tls_set: TlsSet) -> None:
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with tls_set.admin(tls_set.sentinels[0].port) as client:
            if client.execute_command("SENTINEL", "replicas", MASTER):
                return
        time.sleep(0.2)
    raise TimeoutError("the Sentinels did not learn of the replica")


def test_clients_and_the_broker_follow_a_failover_over_tls(tls_set: TlsSet) -> None:
    sync = redis_client(tls_set.url)
    sync.set("before", "1")
    first = tls_set.primary_port()
    broker = celery_config(Settings(redis_url=tls_set.url))
    options = broker["broker_transport_options"]
    assert isinstance(options, dict)
    with Connection(str(broker["broker_url"]), transport_options=options, ssl=broker["broker_use_ssl"]) as conn:
        queue = conn.SimpleQueue("omni-tls-test")
        queue.put({"n": 1})
        assert queue.get(timeout=5).payload == {"n": 1}

        _wait_replica_known(tls_set)
        with tls_set.admin(tls_set.sentinels[0].port) as sentinel:
            sentinel.execute_command("SENTINEL", "FAILOVER", MASTER)  # the old primary turns replica: READONLY
        for i in range(60):  # writes go on through the switch, each retried until the new primary takes it
            sync.incr("counter")
            if tls_set.primary_port() != first:
                break
            asyncio.run(asyncio.sleep(0.1))
        assert tls_set.primary_port() != first
        sync.incr("counter")
        assert sync.get("before") == b"1"

        queue.put({"n": 2})  # the broker's channel reconnects to the new primary
        assert queue.get(timeout=15).payload == {"n": 2}
        queue.close()

    async def streams() -> None:
        for client in (async_client_from_url(tls_set.url), async_client_from_url(tls_set.url, max_connections=2)):
            await client.xadd("events", {"a": "1"})
            assert await client.xlen("events") >= 1
            await client.aclose()

    asyncio.run(streams())
    sync.close()


def test_a_primary_that_answers_nothing_is_left_for_the_new_one(tmp_path: Path) -> None:
    """The primary's machine gone (here: the process stopped, so its port still takes a TCP handshake
    and answers nothing): a command in flight times out, and its retry asks the Sentinels again
    instead of waiting on the old address for every one of its tries (minutes, with redis-py 8.2's own
    reconnect)."""
    import os
    import signal
    import time

    from omni_jobs.local.ha import start_redis_ha

    ha = start_redis_ha(tmp_path / "ha", replicas=1)
    old = ha.primary()
    try:
        sync = redis_client(ha.url)
        sync.set("n", 0)

        async def go() -> float:
            client = async_client_from_url(ha.url, max_connections=2)
            await client.set("m", 0)
            assert old.pid is not None
            os.kill(old.pid, signal.SIGSTOP)
            start = time.monotonic()
            await client.incr("m")
            await client.aclose()
            return time.monotonic() - start

        followed_async = asyncio.run(go())
        start = time.monotonic()
        assert sync.incr("n") == 1
        followed_sync = time.monotonic() - start
        assert ha.primary_port() != old.port
        assert followed_async < 25 and followed_sync < 25, (followed_async, followed_sync)
        sync.close()
    finally:
        if old.pid is not None:
            os.kill(old.pid, signal.SIGCONT)
        ha.stop()
