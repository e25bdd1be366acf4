"""kombu's Redis channel keeps one client for what it sends outside its consumer (workers/broker_fix.py):
a worker's task events go out through it, and a new pool (a reconnect) gets a new client. Real Redis."""

from __future__ import annotations

import base64
import json
import time

import redis
from celery import Celery

from omni_jobs.queueing import celery_config
from omni_jobs.settings import Settings
from workers import broker_fix


def events_app(redis_url: str) -> Celery:
    broker_fix.install()
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
