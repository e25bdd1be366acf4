"""A workaround for kombu's Redis transport when the broker goes away under a threads-pool worker.

Stage workers run a threads pool so that several jobs are in flight (omni_jobs.engines.batching). When
Redis restarts while such a worker holds unacknowledged messages, Celery closes the lost
connection, and then kombu (restoring those messages, or a task thread acknowledging one) asks
the closed channel for its connection parameters: ``AttributeError`` on None, which Celery
treats as unrecoverable, so the worker exits and its jobs wait for another worker. Raising the
broker's own connection error instead lets Celery do what it does for any lost connection:
reconnect; the steps of the messages it held are sent again by the reaper (omni_jobs.leases).
"""

from __future__ import annotations

from typing import Any


def install() -> None:
    import redis
    from kombu.transport import redis as kombu_redis

    original = kombu_redis.Channel._connparams
    if getattr(original, "_omni_patched", False):
        return

    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        if getattr(self, "connection", None) is None or getattr(self.connection, "client", None) is None:
            raise redis.exceptions.ConnectionError("the broker connection of this channel is closed")
        return original(self, asynchronous=asynchronous)

    _connparams._omni_patched = True  # type: ignore[attr-defined]
    kombu_redis.Channel._connparams = _connparams  # type: ignore[method-assign]
