"""Two adjustments to kombu's Redis transport for omni-jobs workers.

**A closed channel raises the broker's connection error.** Stage workers run a threads pool so that
several jobs are in flight (omni_jobs.engines.batching). When Redis restarts while such a worker
holds unacknowledged messages, Celery closes the lost connection, and then kombu (restoring those
messages, or a task thread acknowledging one) asks the closed channel for its connection
parameters: ``AttributeError`` on None, which Celery treats as unrecoverable, so the worker exits
and its jobs wait for another worker. Raising the broker's own connection error instead lets
Celery do what it does for any lost connection: reconnect; the steps of the messages it held are
sent again by the reaper (omni_jobs.leases).

**A channel keeps one Redis client.** kombu builds a new ``redis.Redis`` for every command it sends
outside its consumer (``conn_or_acquire``): about 0.1 ms of CPU each (its ~170 response callbacks),
for every batch of task events a worker publishes (received, started, succeeded; Flower's view).
In a worker that is taken from the step it just handed to a task thread, under the GIL: a stage's
start waited on it (a hop's timeline: the events' flush held the interpreter 0.7-1.5 ms while the
task thread waited). A ``redis.Redis`` is safe to share between threads (each command takes a
connection from the pool); the kept one follows the channel's pool when kombu makes a new one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_CLIENT = "_omni_client"


def install() -> None:
    import redis
    from kombu.transport import redis as kombu_redis

    channel = kombu_redis.Channel
    if getattr(channel._connparams, "_omni_patched", False):
        return
    original = channel._connparams

    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        if getattr(self, "connection", None) is None or getattr(self.connection, "client", None) is None:
            raise redis.exceptions.ConnectionError("the broker connection of this channel is closed")
        return original(self, asynchronous=asynchronous)

    @contextmanager
    def conn_or_acquire(self: Any, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        yield shared_client(self)

    _connparams._omni_patched = True  # type: ignore[attr-defined]
    channel._connparams = _connparams  # type: ignore[method-assign]
    channel.conn_or_acquire = conn_or_acquire  # type: ignore[method-assign]


def shared_client(channel: Any) -> Any:
    """The channel's kept client, made anew when the channel's pool is new (after a reconnect)."""
    pool = channel.pool
    client = channel.__dict__.get(_CLIENT)
    if client is None or client.connection_pool is not pool:
        client = channel._create_client()
        channel.__dict__[_CLIENT] = client
    return client
