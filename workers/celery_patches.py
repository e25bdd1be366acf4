"""The Celery and kombu internals omni-jobs workers change: the one module that does.

Everything here replaces a method of a Celery or kombu class for the whole process, because no
setting or public API gives the behaviour (checked against celery 5.7.0 and kombu 5.7.0). Each patch
names its upstream issue and the test that pins it: that test fails when the patch is not there, so
an upgrade that makes a patch useless, or that moves the method it replaces, shows up in the suite.
``install`` applies them all; workers.app calls it once at import, before any worker starts.

What was here before and is now a setting: the workers neither gossip nor mingle (the
``worker_consumer`` setting, workers/quiet_cluster.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from time import sleep
from typing import Any

_PATCHED = "_omni_patched"
_ORIGINAL = "_omni_original"
_CLIENT = "_omni_client"


def install(handoff_ms: float) -> None:
    """Every patch, for a worker process (idempotent: installing again changes nothing twice)."""
    closed_channel_raises_connection_error()
    channel_keeps_one_client()
    pause_after_handoff(handoff_ms)


def closed_channel_raises_connection_error() -> None:
    """A closed kombu Redis channel asked for its connection parameters raises the broker's connection error.

    Upstream: celery/kombu#582 (the same ``AttributeError`` from ``Channel._connparams`` of a closed
    channel, through ``conn_or_acquire``); closed, and kombu 5.7.0 still reads
    ``self.connection.client`` without a check.

    Stage workers run a threads pool so that several jobs are in flight (omni_jobs.engines.batching).
    When Redis restarts while such a worker holds unacknowledged messages, Celery closes the lost
    connection, and then kombu (restoring those messages, or a task thread acknowledging one) asks the
    closed channel for its connection parameters: ``AttributeError`` on None, which Celery treats as
    unrecoverable, so the worker exits and its jobs wait for another worker. The broker's own
    connection error instead lets Celery do what it does for any lost connection: reconnect; the steps
    of the messages it held are sent again by the reaper (omni_jobs.dispatch.leases).

    Pinned by tests/integration/test_celery_patches.py
    (test_a_task_thread_acking_on_a_closed_channel_gets_a_connection_error).
    """
    import redis
    from kombu.transport import redis as kombu_redis

    channel = kombu_redis.Channel
    if getattr(channel._connparams, _PATCHED, False):
        return
    original = channel._connparams

    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        if getattr(self, "connection", None) is None or getattr(self.connection, "client", None) is None:
            raise redis.exceptions.ConnectionError("the broker connection of this channel is closed")
        return original(self, asynchronous=asynchronous)

    setattr(_connparams, _PATCHED, True)
    channel._connparams = _connparams  # type: ignore[method-assign]


def channel_keeps_one_client() -> None:
    """A kombu Redis channel keeps one ``redis.Redis`` for what it sends outside its consumer.

    Upstream: no celery/kombu issue found for it (kombu 5.7.0's ``Channel.conn_or_acquire`` still
    makes a new client on every call).

    kombu builds a new ``redis.Redis`` for every command it sends outside its consumer
    (``conn_or_acquire``): about 0.1 ms of CPU each (its ~170 response callbacks), for every batch of
    task events a worker publishes (received, started, succeeded; Flower's view). In a worker that is
    taken from the step it just handed to a task thread, under the GIL: a stage's start waited on it
    (the events' flush held the interpreter 0.7-1.5 ms while the task thread waited). A
    ``redis.Redis`` is safe to share between threads (each command takes a connection from the pool);
    the kept one follows the channel's pool when kombu makes a new one (after a reconnect).

    Pinned by tests/integration/test_celery_patches.py (test_task_events_go_out_through_one_kept_client).
    """
    from kombu.transport import redis as kombu_redis

    channel = kombu_redis.Channel
    if getattr(channel.conn_or_acquire, _PATCHED, False):
        return

    @contextmanager
    def conn_or_acquire(self: Any, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        yield shared_client(self)

    setattr(conn_or_acquire, _PATCHED, True)
    channel.conn_or_acquire = conn_or_acquire  # type: ignore[method-assign]


def shared_client(channel: Any) -> Any:
    """The channel's kept client, made anew when the channel's pool is new (after a reconnect)."""
    pool = channel.pool
    client = channel.__dict__.get(_CLIENT)
    if client is None or client.connection_pool is not pool:
        client = channel._create_client()
        channel.__dict__[_CLIENT] = client
    return client


def pause_after_handoff(pause_ms: float) -> None:
    """Celery's threads pool pauses ``pause_ms`` after every task it is given (0: no pause).

    Upstream: no celery/celery issue found for it. Not a setting: the pool is chosen by ``-P threads``
    on every worker's command line, which overrides the ``worker_pool`` setting, so a pool subclass
    named there would not be used.

    A threads-pool worker's consumer thread puts a task on the pool's queue, and then goes on with its
    own work (the task events, its next read from the broker) while holding the GIL: the task's thread,
    woken, waits for it (0.35-0.45 ms of every hop, measured with timestamps at the handoff and at the
    task's start; up to the switch interval). A short pause right after the handoff
    (``OMNI_WORKER_HANDOFF_MS``) gives the GIL to the task's thread, which then runs until its first
    write to Redis, the stage's start. The consumer's own work waits for that: the pause, then until
    that thread lets go of the GIL (a burst of 64 tasks: about 13 ms of pauses in all, spent while those
    tasks start). Every threads-pool worker does it (stages, results, webhooks); the in-process runner
    has no consumer and is not concerned.

    Pinned by tests/unit/test_worker_handoff.py (test_the_task_thread_starts_before_the_consumer_goes_on).
    """
    from celery.concurrency import thread

    pool = thread.TaskPool
    original = getattr(pool.on_apply, _ORIGINAL, pool.on_apply)
    if pause_ms <= 0:
        pool.on_apply = original  # type: ignore[method-assign]
        return
    pause_s = pause_ms / 1000

    def on_apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        applied = original(self, *args, **kwargs)
        sleep(pause_s)  # the GIL goes to the task's thread, just woken
        return applied

    setattr(on_apply, _ORIGINAL, original)
    pool.on_apply = on_apply  # type: ignore[method-assign]
