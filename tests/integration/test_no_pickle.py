"""No pickle: a pickled Celery message sent to a real queue, consumed by a real worker, is refused
and never runs; the same task sent as JSON runs. And no source file unpickles anything."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
from celery import Celery

from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.queueing import celery_config
from omni_jobs.dispatch.scheduling import Scheduler
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import Job, JobWebhook, StageRecord, now
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import DELIVER_WEBHOOK_TASK, DeliverWebhook, task_args
from omni_jobs.local.devservices import RunningService

ROOT = Path(__file__).resolve().parents[2]
NO_PICKLE_DB = 8  # apart from DB 0 (flushed by other tests), 3 (e2e), 6 (refusal), 7 (readiness)


def new_message(ledger: JobLedger) -> tuple[Job, DeliverWebhook]:
    """A canceled job with a ``completed`` webhook message waiting for its first attempt. The step, if
    it ever runs, records that attempt on the job: the marker. Its outbox entry is taken and dropped
    here, so that the only messages on the broker are the ones this test sends."""
    job = Job(id="job_" + uuid.uuid4().hex[:24], pipeline="text-to-text", input={"prompt": "x"},
              stages=[StageRecord(id="ar", engine="ar", queue="ar")],
              webhook=JobWebhook(url="http://127.0.0.1:9/unreachable", events=["completed"]))
    ledger.submit(job, ["ar"])
    ledger.cancel(job.id)
    Scheduler(ledger.store, None).release_all()  # first attempts wait for their turn
    entries = ledger.store.claim_outbox(now=now(), limit=10, hold_s=60.0, job_id=job.id)
    ledger.store.ack_outbox([e.id for e in entries])
    (step,) = [e.step for e in entries]
    assert isinstance(step, DeliverWebhook)
    return job, step


def test_a_pickled_message_is_refused_by_the_worker_and_never_runs(redis_service: RunningService,
                                                                    tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{redis_service.port}/{NO_PICKLE_DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    ledger = JobLedger(RedisJobStore(client, ttl_s=600))
    queue = f"nopickle-{uuid.uuid4().hex[:6]}"
    settings = Settings(redis_url=url)
    assert celery_config(settings)["accept_content"] == ["json"]

    # An attacker-style producer: same broker, same task name, pickle serializer.
    evil = Celery("evil")
    evil.conf.update(broker_url=url, task_serializer="pickle", accept_content=["pickle", "json"])
    (pickled_job, pickled), (json_job, honest_step) = new_message(ledger), new_message(ledger)
    evil.send_task(DELIVER_WEBHOOK_TASK, args=task_args(pickled), queue=queue, serializer="pickle")
    honest = Celery("honest")
    honest.conf.update(celery_config(settings))
    honest.send_task(DELIVER_WEBHOOK_TASK, args=task_args(honest_step), queue=queue)

    log_path = tmp_path / "worker.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    env.update(OMNI_REDIS_URL=url, OMNI_MODELS_DIR=str(ROOT / "var" / "models"), PYTHONUNBUFFERED="1",
               OMNI_ARTIFACTS_DIR=str(tmp_path / "artifacts"), OMNI_VERSION_CHECK="false",
               OMNI_LOG_FORMAT="text")
    argv = [sys.executable, "-m", "celery", "-A", "workers.app:app", "worker", "-Q", queue, "-P", "solo", "-c", "1",
            "-n", f"{queue}@%h", "--loglevel", "INFO"]
    with log_path.open("w") as log:
        worker = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the JSON message behind the pickled one has run: both were consumed
            done = ledger.require(json_job.id)
            if done.webhook is not None and done.webhook.deliveries:
                break
            assert worker.poll() is None, log_path.read_text()
            time.sleep(0.2)
        else:
            raise AssertionError("the JSON task never ran:\n" + log_path.read_text())
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    text = log_path.read_text()
    after = ledger.require(pickled_job.id)
    assert after.webhook is not None and after.webhook.deliveries == [], "the pickled task ran"
    untouched = ledger.store.webhook_slots(pickled_job.id)[pickled.message_id]
    assert (untouched.status, untouched.attempts) == ("queued", 0)  # never even started
    (ran,) = ledger.require(json_job.id).webhook.deliveries  # type: ignore[union-attr]
    assert (ran.id, ran.attempt) == (honest_step.message_id, 1)
    assert re.search(r"[Rr]efusing to deserialize untrusted content of type pickle", text), text[-3000:]
    assert client.llen(queue) == 0  # refused and dropped, not left to be retried forever
    client.flushdb()
    client.close()


def test_no_source_file_unpickles_or_torch_loads_without_weights_only() -> None:
    offenders: list[str] = []
    for package in ("omni_jobs", "workers", "api"):
        for path in (ROOT / package).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if re.search(r"\bimport (c?pickle|dill|shelve)\b|\bpickle\.loads?\(|\bmarshal\.loads?\(", code) or (
                        "torch.load(" in code and "weights_only=True" not in code):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []
