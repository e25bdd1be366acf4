"""Celery tasks: one per kind of step. Each is a few lines around the core.

Transient failures (artifact store or Redis unreachable) are retried with exponential backoff and
jitter (in the worker while the broker is away); anything else fails the job with the stage and
reason recorded, never silently.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any, TypeVar

import redis
from celery import Task, signals
from celery.exceptions import Reject, Retry
from kombu.exceptions import OperationalError as BrokerUnavailable

from omni_jobs import metrics
from omni_jobs.artifacts import ArtifactStoreUnavailable
from omni_jobs.dispatch import (
    ASSEMBLE_RESULTS_TASK,
    CLEANUP_TASK,
    DELIVER_WEBHOOK_TASK,
    RUN_STAGE_TASK,
    SendTaskDispatcher,
)
from omni_jobs.engines.stage_exec import load_stage_engine
from omni_jobs.errors import TransientStageError
from omni_jobs.retention import cleanup
from omni_jobs.runtime import Runtime
from omni_jobs.settings import get_settings
from omni_jobs.stages import StageTimeout
from omni_jobs.watchdog import hard_time_limit
from omni_jobs.worker_registry import start_heartbeat, unregister_worker
from workers import observability, startup
from workers.app import app

log = logging.getLogger(__name__)

TRANSIENT_ERRORS = (ArtifactStoreUnavailable, TransientStageError, redis.ConnectionError, redis.TimeoutError,
                    BrokerUnavailable)
T = TypeVar("T")


@lru_cache(maxsize=1)
def runtime() -> Runtime:
    """One Runtime per worker process: engines load on first use and stay loaded."""
    rt = Runtime(get_settings())
    rt.enable_webhooks(dispatcher)  # job changes committed here send their webhooks
    return rt


def _send(name: str, args: Any, queue: str) -> None:
    observability.send_task(app, name, args, queue)  # named omni.run_stage[job_.../stage] in Flower and logs


dispatcher = SendTaskDispatcher(_send)


def _retry_delay(retries: int) -> float:
    """Exponential backoff with jitter, kept under half the visibility timeout: the Redis broker
    redelivers a retry still waiting for its countdown once the timeout passes (a double run)."""
    settings = get_settings()
    delay = settings.stage_retry_backoff_s * (2**retries) * random.uniform(0.5, 1.5)
    return min(delay, settings.visibility_timeout_s / 2)


def _retrying_transient_errors(task: Task, what: str, attempt: Callable[[], T]) -> T:
    """Run ``attempt``; after a transient error, retry it up to OMNI_STAGE_MAX_RETRIES times with
    backoff, then let the error out.

    A retry is a new message (Celery's ``retry``), so no worker thread waits. When the broker itself
    is away, that message cannot be sent, and Celery would drop the task (``Reject(requeue=False)``),
    leaving its job running forever. So this worker holds the task (acks_late) and retries it here.
    """
    max_retries = get_settings().stage_max_retries
    while True:
        try:
            return attempt()
        except TRANSIENT_ERRORS as exc:
            retries = int(task.request.retries or 0)
            if retries >= max_retries:
                raise
            delay = _retry_delay(retries)
            log.warning("%s: transient error, retry %d of %d in %.1fs: %s", what, retries + 1, max_retries, delay, exc)
            try:
                raise task.retry(exc=exc, countdown=delay) from exc
            except Reject:  # the retry could not be sent: the broker is away too
                log.warning("%s: the broker is unreachable; retrying in this worker", what)
                task.request.retries = retries + 1
                time.sleep(delay)


@app.task(name=RUN_STAGE_TASK, bind=True, acks_late=True, max_retries=None)  # our own limit: stage_max_retries
def run_stage(self: Task, job_id: str, stage_id: str) -> str:
    rt = runtime()

    def attempt() -> str:
        _soft, hard = rt.stage_runner.time_limits(job_id, stage_id)
        on_expire = partial(rt.stage_runner.fail, job_id, stage_id, StageTimeout(
            f"stage '{stage_id}' ran past its hard time limit of {hard:g}s; its worker was restarted "
            "(set time_limit_s on the stage or OMNI_STAGE_TIME_LIMIT_S)"))
        with hard_time_limit(hard, on_expire):
            outcome = rt.stage_runner.run(job_id, stage_id, worker=str(self.request.hostname))
        if outcome.status in ("succeeded", "failed"):
            observability.record_stage_memory(rt, job_id, stage_id)
        for step in outcome.next_steps:  # a failed send re-runs the attempt: an advance-only redelivery
            dispatcher.dispatch(step)
        return outcome.status

    try:
        return _retrying_transient_errors(self, f"job {job_id} stage {stage_id}", attempt)
    except Retry:  # a retry message was sent: the job is not failed
        raise
    except TRANSIENT_ERRORS as exc:
        rt.stage_runner.fail(job_id, stage_id, exc)  # if Redis is still away, this raises: redelivered later
        return "failed"
    except Exception as exc:
        rt.stage_runner.fail(job_id, stage_id, exc)
        raise


@app.task(name=ASSEMBLE_RESULTS_TASK, bind=True, acks_late=True, max_retries=None)
def assemble_results(self: Task, job_id: str) -> str:
    rt = runtime()
    try:
        job = _retrying_transient_errors(self, f"job {job_id} results", lambda: rt.results.assemble(job_id))
    except Retry:
        raise
    except TRANSIENT_ERRORS as exc:
        rt.stage_runner.fail(job_id, None, exc)
        return "failed"
    except Exception as exc:
        rt.stage_runner.fail(job_id, None, exc)
        raise
    return job.status.value if job else "gone"


@app.task(name=CLEANUP_TASK)
def run_cleanup() -> dict[str, int]:
    """Periodic retention (scheduled by ``celery beat``; see omni_jobs.queueing)."""
    rt = runtime()
    s = rt.settings
    report = cleanup(rt.jobs, rt.artifacts, output_ttl_s=s.output_ttl_s, intermediate_ttl_s=s.intermediate_ttl_s,
                     max_deadline_s=s.max_cancel_after_s)
    return dict(report.__dict__)


@app.task(name=DELIVER_WEBHOOK_TASK, bind=True, acks_late=True, max_retries=None)
def deliver_webhook(self: Task, job_id: str, message_id: str, event: str) -> str:
    """One attempt per run; a retry keeps the same message id (webhook-id) and counts the attempt."""
    outcome = runtime().webhooks.deliver(job_id, message_id, event, attempt=self.request.retries + 1)
    metrics.webhook_delivery(event, outcome.status)
    if outcome.retry_in_s is not None:
        raise self.retry(countdown=outcome.retry_in_s)
    return outcome.status


@signals.worker_init.connect
def on_worker_init(sender: Any = None, **_: Any) -> None:
    """Before the broker is touched: refuse to start when an engine library is out of its range."""
    if sender is None:
        return
    startup.check_versions(str(sender.hostname), runtime().catalogue, startup.consumed_queues(sender), get_settings())


@signals.worker_ready.connect
def on_worker_ready(sender: Any = None, **_: Any) -> None:
    """Preload this worker's engines, then announce it (readiness means: can serve at once).

    A model that cannot load stops the worker here (see workers.startup and OMNI_REFUSE_BROKEN_MODELS).
    """
    if sender is None:
        return
    queues = sorted(q.name for q in sender.task_consumer.queues)
    settings = get_settings()
    if settings.preload_engines:
        startup.check_models(str(sender.hostname), preload_engines(set(queues)), settings)
    rt = runtime()
    _heartbeat["stop"] = start_heartbeat(rt.redis, str(sender.hostname), queues)
    _heartbeat["name"] = str(sender.hostname)


@signals.worker_shutdown.connect
def on_worker_shutdown(**_: Any) -> None:
    stop = _heartbeat.get("stop")
    if isinstance(stop, threading.Event):
        stop.set()
        unregister_worker(runtime().redis, str(_heartbeat["name"]))


_heartbeat: dict[str, object] = {}


def preload_engines(queues: set[str]) -> list[startup.LoadFailure]:
    """Load the engines of the stages on these queues before the first task arrives; returns what failed."""
    rt = runtime()
    failures: list[startup.LoadFailure] = []
    for spec in rt.catalogue:
        for stage in spec.stages:
            if stage.queue_name in queues:
                log.info("preloading %s engine for %s/%s (%s)", stage.engine, spec.name, stage.id, stage.model)
                try:
                    load_stage_engine(rt.engines, stage)  # the engine of its (kind, task), checked against it
                except Exception as exc:
                    log.exception("cannot load the engine of %s/%s", spec.name, stage.id)
                    failures.append((spec, stage, exc))
                    continue
                metrics.record_engine_memory(spec.name, stage.id, stage.engine)
    return failures
