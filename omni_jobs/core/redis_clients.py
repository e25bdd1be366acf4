"""The one place a Redis URL becomes a client, sync or asyncio: the job store, the event streams, the
API's reads, the CLI and the workers all get theirs here, so that a ``sentinel://`` URL
(docs/reliability.md, "Redis failover") works everywhere the same way.

A Sentinel URL gives a client of redis-py's ``master_for``: each new connection asks the Sentinels
where the primary is, a connection error or a READONLY answer (a primary demoted to a replica)
drops the connection, and the next try finds the new primary. The tries span
``FAILOVER_RETRY_S``: the Sentinels need ``down-after-milliseconds`` to agree that the primary is
gone, then a second or so to promote a replica; a command sent in that window waits it out instead
of failing its request or its job.
"""

from __future__ import annotations

from typing import Any, TypedDict

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as asentinel
import redis.sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff, ExponentialWithJitterBackoff
from redis.retry import Retry

from omni_jobs.core.redis_url import SentinelUrl, is_sentinel_url, parse_sentinel_url

__all__ = ["FAILOVER_RETRY_S", "RetryOptions", "async_client_from_url", "async_retry_options", "redis_client"]

FAILOVER_RETRY_S = 15.0
"""How long a command on a Sentinel client keeps trying through a failover: a Sentinel's
``down-after-milliseconds`` (``omni-jobs up`` and compose: 2 s and 5 s) and the promotion after it,
with room to spare. A longer ``down-after-milliseconds`` outlasts it: the command then fails as it
would with Redis down (the API answers 503, a worker's writes wait OMNI_STORE_WAIT_S)."""
_BACKOFF_BASE_S, _BACKOFF_CAP_S = 0.05, 0.5
SENTINEL_TIMEOUT_S = 2.0
"""Connect and read timeout of a question to one Sentinel: an unreachable one is passed over for the
next, rather than holding every new connection."""
PRIMARY_TIMEOUT_S, PRIMARY_CONNECT_TIMEOUT_S = 10.0, 2.0
"""A Sentinel client's read and connect timeouts where its caller names none. A primary whose machine
is gone (or cut off) answers nothing, not even a reset: without them a command would wait on it for
the kernel's minutes, not fail over. The longest command a sync client sends blocks for 0.5 s (a
stage's XREAD), a WAIT for OMNI_REDIS_WAIT_TIMEOUT_MS; a caller that blocks longer names its own."""
POOL_WAIT_S = 5.0
"""How long a caller waits for a connection of a bounded pool (``max_connections``) before a
ConnectionError (the API: a 503)."""


def _failover_tries() -> int:
    """Retries whose backoffs (base doubling up to the cap) add up to FAILOVER_RETRY_S."""
    total, tries, wait = 0.0, 0, _BACKOFF_BASE_S
    while total < FAILOVER_RETRY_S:
        total += min(wait, _BACKOFF_CAP_S)
        wait *= 2
        tries += 1
    return tries


def failover_retry() -> Retry:
    """The retry of a sync Sentinel client's connections (connection errors and timeouts)."""
    return Retry(ExponentialBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S), _failover_tries())


def async_failover_retry() -> AsyncRetry:
    """``failover_retry`` for redis.asyncio."""
    return AsyncRetry(ExponentialBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S), _failover_tries())


class RetryOptions(TypedDict):
    retry: AsyncRetry
    retry_on_error: list[type[Exception]]


def async_retry_options() -> RetryOptions:
    """Retry a command on a dropped connection, as redis-py's sync client does by default.

    redis.asyncio does not: after Redis restarts, each pooled connection fails its next command with
    "Connection closed by server" once, so the API answered 503 to requests that a reconnect would
    have served. A retried write is safe here: every commit is guarded (a submit expects the job to
    be absent, a transition expects the fields it read), so one that did apply the first time
    conflicts instead of applying twice."""
    return {"retry": AsyncRetry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3),
            "retry_on_error": [redis.ConnectionError, redis.TimeoutError]}


def _sentinel_kwargs(target: SentinelUrl) -> dict[str, Any]:
    """How to reach and log in to the Sentinels themselves."""
    kwargs: dict[str, Any] = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S}
    if target.sentinel_password is not None:
        kwargs["password"] = target.sentinel_password
    if target.sentinel_username is not None:
        kwargs["username"] = target.sentinel_username
    return {**kwargs, **_tls(target)}


def _tls(target: SentinelUrl) -> dict[str, Any]:
    if not target.tls:
        return {}
    return {"ssl": True, **({"ssl_ca_certs": target.ssl_ca_certs} if target.ssl_ca_certs is not None else {})}


class _Following(redis.sentinel.SentinelManagedConnection):
    """A connection to the primary that, connecting again after an error, asks the Sentinels where the
    primary is now. redis-py 8.2 does so only when a pool hands a connection out: a command retried
    after its connection broke reconnected to the old address, which, where the primary's machine is
    gone, accepts nothing or nothing but a TCP handshake: each retry then waited a full read timeout,
    for minutes, while the Sentinels already named the new primary."""

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self._sock:
            self.connect()  # type: ignore[no-untyped-call]  # redis-py; the Sentinel-aware connect
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]  # redis-py


class _FollowingSSL(_Following, redis.sentinel.SentinelManagedSSLConnection):
    """``_Following`` over TLS."""


class _AsyncFollowing(asentinel.SentinelManagedConnection):
    """``_Following`` for redis.asyncio."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self.is_connected:
            await self.connect()  # type: ignore[no-untyped-call]  # redis-py
        await super().send_packed_command(command, check_health)


class _AsyncFollowingSSL(_AsyncFollowing, asentinel.SentinelManagedSSLConnection):
    """``_AsyncFollowing`` over TLS."""


def _primary_kwargs(target: SentinelUrl, options: dict[str, Any]) -> dict[str, Any]:
    """How to log in to the primary (database, credentials, TLS), with the caller's options."""
    kwargs: dict[str, Any] = {"db": target.db, **options}
    if target.password is not None:
        kwargs["password"] = target.password
    if target.username is not None:
        kwargs["username"] = target.username
    return {**kwargs, **_tls(target)}


def _options(socket_timeout: float | None, socket_connect_timeout: float | None, decode_responses: bool,
             health_check_interval: int) -> dict[str, Any]:
    options: dict[str, Any] = {"health_check_interval": health_check_interval}
    if socket_timeout is not None:
        options["socket_timeout"] = socket_timeout
    if socket_connect_timeout is not None:
        options["socket_connect_timeout"] = socket_connect_timeout
    if decode_responses:
        options["decode_responses"] = True
    return options


def redis_client(url: str, *, setting: str = "OMNI_REDIS_URL", socket_timeout: float | None = None,
                 socket_connect_timeout: float | None = None, decode_responses: bool = False,
                 health_check_interval: int = 0) -> redis.Redis:
    """A sync client for ``url``: one server, or the primary that Sentinels name (following it through
    failovers). ``setting`` is named when a Sentinel URL is malformed (RedisUrlInvalid)."""
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **_options(socket_timeout, socket_connect_timeout, decode_responses,
                                                    health_check_interval))
    target = parse_sentinel_url(url, setting)
    options = _options(PRIMARY_TIMEOUT_S if socket_timeout is None else socket_timeout,
                       PRIMARY_CONNECT_TIMEOUT_S if socket_connect_timeout is None else socket_connect_timeout,
                       decode_responses, health_check_interval)
    sentinel = redis.sentinel.Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target))
    kwargs = _primary_kwargs(target, {**options, "retry": failover_retry()})
    kwargs["connection_class"] = _FollowingSSL if target.tls else _Following
    client: redis.Redis = sentinel.master_for(target.master, **kwargs)
    return client


class _BlockingSentinelPool(asentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """A Sentinel pool that, at ``max_connections``, makes a caller wait for a connection (as
    BlockingConnectionPool does) instead of failing it."""


def async_client_from_url(url: str, *, setting: str = "OMNI_REDIS_URL", socket_timeout: float | None = None,
                          max_connections: int | None = None, health_check_interval: int = 30) -> aioredis.Redis:
    """A redis.asyncio client for ``url`` that reconnects and retries like the sync one (a Sentinel
    URL: through a failover). ``socket_timeout``: None keeps redis-py's default. ``max_connections``:
    at most this many connections at once; a caller past them waits (up to POOL_WAIT_S, then
    ConnectionError: a 503), where redis-py's default pool opens as many as it is asked for."""
    options = _options(socket_timeout, None, False, health_check_interval)
    if is_sentinel_url(url):
        target = parse_sentinel_url(url, setting)
        options = _options(PRIMARY_TIMEOUT_S if socket_timeout is None else socket_timeout,
                           PRIMARY_CONNECT_TIMEOUT_S, False, health_check_interval)
        sentinel = asentinel.Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target))
        kwargs = _primary_kwargs(target, {**options, "retry": async_failover_retry()})
        kwargs["connection_class"] = _AsyncFollowingSSL if target.tls else _AsyncFollowing
        if max_connections is not None:  # bounded: a caller past them waits
            kwargs.update(connection_pool_class=_BlockingSentinelPool, max_connections=max_connections,
                          timeout=POOL_WAIT_S)
        aclient: aioredis.Redis = sentinel.master_for(target.master, **kwargs)
        return aclient
    if max_connections is not None:
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=POOL_WAIT_S,
                                                        **options, **async_retry_options())
        return aioredis.Redis(connection_pool=pool)
    return aioredis.Redis.from_url(url, **options, **async_retry_options())
