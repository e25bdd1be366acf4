"""The kombu patches of workers/celery_patches.py, each pinned on a real Redis (each test fails without its patch):
- a kombu Redis channel keeps one client for what it sends outside its consumer: a worker's task events go out
  through it, and a new pool (a reconnect) gets a new client;
- a closed channel asked for a client raises the broker's connection error, one Celery recovers from, where
  kombu raised AttributeError (a threads-pool worker exited when Redis restarted).

The handoff pause is pinned in tests/unit/test_worker_handoff.py, the quiet consumer in
tests/integration/test_quiet_cluster.py."""

from __future__ import annotations

import base64
import json
import time

import pytest
import redis
from celery import Celery
from kombu import Connection, Queue

from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.queueing import celery_config
from workers import celery_patches


def events_app(redis_url: str) -> Celery:
    celery_patches.channel_keeps_one_client()
    app = Celery("broker-client-test")
    app.conf.update(celery_config(Settings(redis_url=redis_url)))
    return app


def test_task_events_go_out_through_one_kept_client(redis_url: str, redis_client: redis.Redis) -> None:
    app = events_app(redis_url)
    listener = redis_client.pubsub()
    listener.psubscribe("*celeryev*")
    listener.get_message(timeout=1)  # the subscription's confirmation
    with app.connection_for_write() as conn:
        dispatcher = app.events.Dispatcher(conn, hostname="w@test", enabled=True, buffer_group=["task"])
        channel = dispatcher.producer.channel
        for i in range(3):
            dispatcher.send("task-received", uuid=f"t{i}", name="omni.run_stage")
            dispatcher.flush()
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second and first.connection_pool is channel.pool
        received: list[str] = []
        deadline = time.monotonic() + 5
        while len(received) < 3 and time.monotonic() < deadline:
            message = listener.get_message(timeout=0.5)
            if message and message["type"] == "pmessage":
                envelope = json.loads(message["data"])
                body = json.loads(base64.b64decode(envelope["body"]))  # kombu's body_encoding: base64
                # the test Redis is shared: other tests' workers send their own events (heartbeats) on it
                received += [e["uuid"] for e in (body if isinstance(body, list) else [body])
                             if e.get("hostname") == "w@test"]
        assert received == ["t0", "t1", "t2"]
        old = first
        channel._pool = None  # what kombu does when it makes its connection pool anew
        with channel.conn_or_acquire() as third:
            assert third is not old and third.connection_pool is channel.pool
            assert third.ping()
        with channel.conn_or_acquire(old) as given:
            assert given is old  # a client the caller hands in is used as it is
    listener.close()


def test_a_task_thread_acking_on_a_closed_channel_gets_a_connection_error(redis_url: str,
                                                                         redis_client: redis.Redis) -> None:
    """A worker lost its broker: the channel's unacknowledged messages were restored and the channel closed.
    A task thread that finishes then acknowledges its message on that channel: the error must be one of the
    connection's recoverable ones (Celery reconnects), not AttributeError (Celery's worker exits)."""
    celery_patches.closed_channel_raises_connection_error()
    queue = Queue("celery-patches-closed")
    with Connection(redis_url) as conn:
        channel = conn.channel()
        conn.Producer(channel).publish({"step": 1}, routing_key=queue.name, declare=[queue])
        message = channel.basic_get(queue.name, no_ack=False)
        assert message is not None
        channel.qos.restore_unacked_once()  # what the consumer's close does with the messages it held
        channel.close()
        with pytest.raises(conn.recoverable_connection_errors, match="closed"):
            message.ack()
    redis_client.delete(queue.name)
