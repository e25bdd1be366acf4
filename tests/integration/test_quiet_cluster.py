"""Workers neither gossip nor mingle (workers/quiet_cluster.py), however they are started.

A real Celery worker process on the session Redis, started with a plain command line (no
``--without-gossip``): it subscribes to no other worker's events (its only pattern subscription is
its control mailbox), it does not search for neighbours at start, and it still answers Flower's
and ``celery inspect``'s broadcast.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
from celery import Celery

from omni_jobs.local.devservices import RunningService
from omni_jobs.queueing import celery_config
from omni_jobs.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
QUIET_DB = 10  # apart from 0 (flushed by other tests), 3 (e2e), 5 (ui), 6 (refusal), 7 (readiness), 8, 9


def pattern_subscriptions(client: redis.Redis, db: int) -> int:
    """Pattern subscriptions of the clients connected to ``db`` (kombu's fanout: PSUBSCRIBE)."""
    return sum(int(c.get("psub", 0)) for c in client.client_list() if int(c.get("db", -1)) == db)


def test_a_worker_neither_gossips_nor_mingles_and_still_answers_a_broadcast(redis_service: RunningService,
                                                                             tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{redis_service.port}/{QUIET_DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    assert pattern_subscriptions(client, QUIET_DB) == 0
    queue = f"quiet-{uuid.uuid4().hex[:6]}"
    log_path = tmp_path / "worker.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    env.update(OMNI_REDIS_URL=url, OMNI_MODELS_DIR=str(ROOT / "var" / "models"), PYTHONUNBUFFERED="1",
               OMNI_ARTIFACTS_DIR=str(tmp_path / "artifacts"), OMNI_VERSION_CHECK="false", OMNI_LOG_FORMAT="text")
    argv = [sys.executable, "-m", "celery", "-A", "workers.app:app", "worker", "-Q", queue, "-P", "solo", "-c", "1",
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
        replies = control.control.ping(timeout=5.0)
        assert any(f"{queue}@" in name for reply in replies for name in reply), replies  # remote control works
        assert pattern_subscriptions(client, QUIET_DB) == 1  # its mailbox; a gossiping worker has 2
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        control.close()
    assert "mingle" not in log_path.read_text()  # "mingle: searching for neighbors" cost a second at start
    client.flushdb()
    client.close()
