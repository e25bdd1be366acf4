"""Workers add nobody's load but their own (workers/quiet_cluster.py: the worker_consumer setting; OMNI_WORKER_TASK_EVENTS).

Real Celery worker processes on the session Redis, started with a plain command line (no
``--without-gossip``, no ``-E``):
- a worker subscribes to no other worker's events (its only pattern subscription is its control
  mailbox), does not search for neighbours at start, and still answers Flower's and ``celery
  inspect``'s broadcast;
- it sends no task events until a monitor asks (``enable_events``), and then does: a Flower started
  beside it shows its tasks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

import httpx
import redis
from celery import Celery

from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.queueing import celery_config
from omni_jobs.jobs.steps import CLEANUP_TASK
from omni_jobs.local.devservices import RunningService, free_port

ROOT = Path(__file__).resolve().parents[2]
QUIET_DB = 10  # apart from 0 (flushed by other tests), 3 (e2e), 5 (ui), 6 (refusal), 7 (readiness), 8, 9


def pattern_subscriptions(client: redis.Redis, db: int) -> int:
    """Pattern subscriptions of the clients connected to ``db`` (kombu's fanout: PSUBSCRIBE)."""
    return sum(int(c.get("psub", 0)) for c in client.client_list() if int(c.get("db", -1)) == db)


@contextmanager
def plain_worker(url: str, queue: str, tmp_path: Path, pool: str = "solo") -> Iterator[tuple[Path, Celery]]:
    """A worker on ``queue`` as an operator would start it (no OMNI_ settings but where things live),
    ready; its log, and a Celery app to control it with."""
    log_path = tmp_path / "worker.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    env.update(OMNI_REDIS_URL=url, OMNI_MODELS_DIR=str(ROOT / "var" / "models"), PYTHONUNBUFFERED="1",
               OMNI_ARTIFACTS_DIR=str(tmp_path / "artifacts"), OMNI_VERSION_CHECK="false", OMNI_LOG_FORMAT="text")
    argv = [sys.executable, "-m", "celery", "-A", "workers.app:app", "worker", "-Q", queue, "-P", pool, "-c", "1",
            "-n", f"{queue}@%h", "--loglevel", "INFO"]
    with log_path.open("w") as log:
        worker = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    control = Celery("control")
    control.conf.update(celery_config(Settings(redis_url=url)))
    try:
        deadline = time.monotonic() + 60
        while "ready." not in log_path.read_text():
            assert worker.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        yield log_path, control
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        control.close()


def test_a_worker_neither_gossips_nor_mingles_and_still_answers_a_broadcast(redis_service: RunningService,
                                                                             tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{redis_service.port}/{QUIET_DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    assert pattern_subscriptions(client, QUIET_DB) == 0
    queue = f"quiet-{uuid.uuid4().hex[:6]}"
    with plain_worker(url, queue, tmp_path) as (log_path, control):
        replies = control.control.ping(timeout=5.0)
        assert any(f"{queue}@" in name for reply in replies for name in reply), replies  # remote control works
        assert pattern_subscriptions(client, QUIET_DB) == 1  # its mailbox; a gossiping worker has 2
    assert "mingle" not in log_path.read_text()  # "mingle: searching for neighbors" cost a second at start
    client.flushdb()
    client.close()


class TaskEvents:
    """The task events on the broker's event exchange, as Flower receives them, gathered by a thread."""

    def __init__(self, app: Celery) -> None:
        self.seen: list[dict[str, Any]] = []
        self._app = app
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._capture, daemon=True)

    def _capture(self) -> None:
        with self._app.connection_for_read() as conn:
            receiver = self._app.events.Receiver(conn, handlers={"*": self._on_event})
            subscribed = receiver.on_consume_ready

            def on_consume_ready(*args: Any, **kwargs: Any) -> None:
                subscribed(*args, **kwargs)
                self._ready.set()

            receiver.on_consume_ready = on_consume_ready  # type: ignore[method-assign]
            self._receiver = receiver
            receiver.capture(limit=None, timeout=None, wakeup=False)  # until should_stop

    def _on_event(self, event: dict[str, Any]) -> None:
        if str(event.get("type", "")).startswith("task-"):
            self.seen.append(event)

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        self._receiver.should_stop = True  # seen within its next second of waiting
        self._thread.join(timeout=5)

    def of(self, task_id: str, worker: str) -> set[str]:
        """The types of the events ``worker`` (its node name's prefix) sent about ``task_id``."""
        return {e["type"] for e in self.seen if e.get("uuid") == task_id and str(e.get("hostname")).startswith(worker)}


def run_task(control: Celery, queue: str, log_path: Path) -> str:
    """The retention task, run by the worker on ``queue``; its id once the worker logged it done."""
    task_id = send_task(control, queue)
    deadline = time.monotonic() + 60
    while f"[{task_id}] succeeded" not in log_path.read_text():
        assert time.monotonic() < deadline, log_path.read_text()[-2000:]
        time.sleep(0.2)
    return task_id


def send_task(control: Celery, queue: str) -> str:
    """The retention task, sent to the worker on ``queue``; its id."""
    task_id = f"cleanup-{uuid.uuid4().hex[:8]}"
    control.send_task(CLEANUP_TASK, queue=queue, task_id=task_id)
    return task_id


def test_task_events_go_out_once_a_monitor_asks(redis_service: RunningService, tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{redis_service.port}/{QUIET_DB}"
    queue = f"events-{uuid.uuid4().hex[:6]}"
    with plain_worker(url, queue, tmp_path, pool="threads") as (log_path, control), TaskEvents(control) as events:
        unwatched = run_task(control, queue, log_path)
        replies = control.control.enable_events(reply=True, timeout=5.0)  # what Flower sends every 5 s
        assert any(f"{queue}@" in name for reply in replies for name in reply), replies
        watched = run_task(control, queue, log_path)
        deadline = time.monotonic() + 10
        while "task-succeeded" not in events.of(watched, f"{queue}@") and time.monotonic() < deadline:
            time.sleep(0.1)
    assert events.of(unwatched, f"{queue}@") == set()
    assert {"task-received", "task-started", "task-succeeded"} <= events.of(watched, f"{queue}@")
    redis.Redis.from_url(url).flushdb()


def test_flower_started_beside_a_worker_shows_its_tasks(redis_service: RunningService, tmp_path: Path) -> None:
    """Flower asks for task events within 5 s of its start (and every 5 s after): a task the worker runs
    from then on is in Flower's task list, succeeded."""
    url = f"redis://127.0.0.1:{redis_service.port}/{QUIET_DB}"
    queue = f"flower-{uuid.uuid4().hex[:6]}"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    env.update(OMNI_REDIS_URL=url, OMNI_VERSION_CHECK="false")
    with plain_worker(url, queue, tmp_path, pool="threads") as (_log_path, control):
        with (tmp_path / "flower.log").open("w") as log:
            flower = subprocess.Popen([sys.executable, "-m", "celery", "-A", "workers.app:app", "flower",
                                       "--address=127.0.0.1", f"--port={port}", "--basic-auth=u:p"],
                                      cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", auth=("u", "p"), timeout=5)
            shown: dict[str, Any] = {}
            sent: list[str] = []
            deadline = time.monotonic() + 30
            while not any(t.get("state") == "SUCCESS" for t in shown.values()) and time.monotonic() < deadline:
                sent.append(send_task(control, queue))
                time.sleep(1.0)
                try:
                    shown = client.get("/api/tasks").json()
                except httpx.HTTPError:
                    continue  # Flower still starting
            assert any(shown.get(task_id, {}).get("state") == "SUCCESS" for task_id in sent), (
                shown, (tmp_path / "flower.log").read_text()[-2000:])
        finally:
            flower.terminate()
            flower.wait(timeout=30)
    redis.Redis.from_url(url).flushdb()
