"""Celery tasks: one per kind of step. Each is a few lines around the core.

Transient failures (artifact store or Redis unreachable) are retried with exponential backoff and
jitter; anything else fails the job with the stage and reason recorded, never silently.
"""

from __future__ import annotations

import logging
import random
import threading
from functools import lru_cache
from typing import Any

import redis
from celery import Task, signals

from omni_jobs.artifacts import ArtifactStoreUnavailable
from omni_jobs.dispatch import ASSEMBLE_RESULTS_TASK, RUN_STAGE_TASK, SendTaskDispatcher
from omni_jobs.errors import TransientStageError
from omni_jobs.runtime import Runtime
from omni_jobs.settings import get_settings
from omni_jobs.worker_registry import start_heartbeat, unregister_worker
from workers.app import app

log = logging.getLogger(__name__)

TRANSIENT_ERRORS = (ArtifactStoreUnavailable, TransientStageError, redis.ConnectionError, redis.TimeoutError)


@lru_cache(maxsize=1)
def runtime() -> Runtime:
    """One Runtime per worker process: engines load on first use and stay loaded."""
    return Runtime(get_settings())


def _send(name: str, args: Any, queue: str) -> None:
    app.send_task(name, args=list(args), queue=queue)


dispatcher = SendTaskDispatcher(_send)


def _retry_delay(retries: int) -> float:
    base = get_settings().stage_retry_backoff_s * (2**retries)
    return base * random.uniform(0.5, 1.5)


@app.task(name=RUN_STAGE_TASK, bind=True, acks_late=True)
def run_stage(self: Task, job_id: str, stage_id: str) -> str:
    rt = runtime()
    try:
        outcome = rt.stage_runner.run(job_id, stage_id, worker=str(self.request.hostname))
    except TRANSIENT_ERRORS as exc:
        if self.request.retries >= rt.settings.stage_max_retries:
            rt.stage_runner.fail(job_id, stage_id, exc)
            return "failed"
        log.warning("job %s stage %s: transient error, retrying: %s", job_id, stage_id, exc)
        raise self.retry(exc=exc, countdown=_retry_delay(self.request.retries), max_retries=None) from exc
    except Exception as exc:
        rt.stage_runner.fail(job_id, stage_id, exc)
        raise
    for step in outcome.next_steps:
        dispatcher.dispatch(step)
    return outcome.status


@app.task(name=ASSEMBLE_RESULTS_TASK, bind=True, acks_late=True)
def assemble_results(self: Task, job_id: str) -> str:
    rt = runtime()
    try:
        job = rt.results.assemble(job_id)
    except TRANSIENT_ERRORS as exc:
        if self.request.retries >= rt.settings.stage_max_retries:
            rt.stage_runner.fail(job_id, None, exc)
            return "failed"
        raise self.retry(exc=exc, countdown=_retry_delay(self.request.retries), max_retries=None) from exc
    except Exception as exc:
        rt.stage_runner.fail(job_id, None, exc)
        raise
    return job.status.value if job else "gone"


@signals.worker_ready.connect
def on_worker_ready(sender: Any = None, **_: Any) -> None:
    """Preload this worker's engines, then announce it (readiness means: can serve at once)."""
    if sender is None:
        return
    queues = sorted(q.name for q in sender.task_consumer.queues)
    if get_settings().preload_engines:
        preload_engines(set(queues))
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


def preload_engines(queues: set[str]) -> None:
    """Load the engines of the stages on these queues before the first task arrives."""
    rt = runtime()
    for spec in rt.catalogue:
        for stage in spec.stages:
            if stage.queue_name in queues:
                log.info("preloading %s engine for %s/%s (%s)", stage.engine, spec.name, stage.id, stage.model)
                try:
                    if stage.engine == "ar":
                        rt.engines.ar(stage.model, stage.engine_args)
                    else:
                        rt.engines.dit(stage.model, stage.engine_args)
                except Exception:
                    log.exception("cannot load the engine of %s/%s; its jobs will fail with this error",
                                  spec.name, stage.id)
