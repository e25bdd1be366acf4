"""What an operator sees of a worker: JSON logs carrying the task's job id, stage and task id, task
names that contain the job id (Flower, logs), and a Prometheus endpoint on OMNI_METRICS_PORT.

Imported by workers.app, so its signal handlers are connected before Celery sets up logging.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from celery import signals

from omni_jobs.core.logs import bind, configure_logging
from omni_jobs.core.settings import get_settings
from omni_jobs.jobs.steps import task_subject
from omni_jobs.report import metrics

if TYPE_CHECKING:
    from omni_jobs.jobs.models import Job
    from omni_jobs.runtime import Runtime

log = logging.getLogger(__name__)

_unbind: dict[str, Callable[[], None]] = {}
_server: dict[str, Any] = {}


@signals.setup_logging.connect
def on_setup_logging(loglevel: Any = None, **_: Any) -> None:
    """Replace Celery's log setup: one handler, JSON (or text) lines with the context ids."""
    settings = get_settings()
    configure_logging(settings.log_format, loglevel or settings.log_level, service="worker")


@signals.task_prerun.connect
def on_task_prerun(task_id: str | None = None, task: Any = None, args: Sequence[Any] | None = None,
                   **_: Any) -> None:
    """Every log line of the task carries its job id, stage and task id."""
    if task_id is None:
        return
    job_id, stage = task_subject(getattr(task, "name", ""), list(args or []))
    _unbind[task_id] = bind(job_id=job_id, stage=stage, task_id=task_id)


@signals.task_postrun.connect
def on_task_postrun(task_id: str | None = None, **_: Any) -> None:
    reset = _unbind.pop(task_id or "", None)
    if reset is not None:
        reset()


@signals.worker_init.connect
def on_worker_init(**_: Any) -> None:
    metrics.install()  # the core's telemetry as Prometheus metrics (prefork children inherit it)
    metrics.prepare_multiprocess_dir()  # before the prefork children start writing there
    start_metrics(get_settings().metrics_port)


@signals.worker_process_shutdown.connect
def on_worker_process_shutdown(pid: int | None = None, **_: Any) -> None:
    """A prefork child exits: in multiprocess mode its live gauges must stop counting."""
    metrics.mark_process_dead(pid or os.getpid())


def start_metrics(port: int) -> None:
    """Serve /metrics on ``port`` (0: off). A busy port is logged, not fatal: the worker still works."""
    if not port or "server" in _server:
        return
    try:
        _server["server"] = metrics.start_metrics_server(port)
    except OSError as exc:
        log.error("cannot serve metrics on port %d (%s): give each worker on a host its own OMNI_METRICS_PORT",
                  port, exc)
        return
    log.info("serving Prometheus metrics on port %d", port)


STAGE_MEMORY_EVERY_S = 1.0
"""A stage's engine-memory gauge is read again at most this often (a scrape comes every 15 s or so)."""
_memory_read: dict[tuple[str, str], float] = {}
_memory_lock = threading.Lock()


def record_stage_memory(rt: Runtime, job_id: str, stage_id: str, snapshot: Job | None = None) -> None:
    """After a stage ran here: what its engine's worker holds, labelled by pipeline and stage; once a
    ``STAGE_MEMORY_EVERY_S`` per pipeline and stage (reading /proc after each of a batch's 32 jobs cost
    the DiT worker 0.17 ms of CPU a job, three system calls each handing the interpreter's lock away).

    The labels come from ``snapshot`` (the job its task message carried) where there is one: a
    pipeline's name and a stage's engine never change, so reading the job again for them only cost a
    round trip and a decode per stage."""
    try:
        job = snapshot if snapshot is not None and snapshot.id == job_id else rt.ledger.get(job_id)
        if job is None:
            return
        now, labels = time.monotonic(), (job.pipeline, stage_id)
        with _memory_lock:
            last = _memory_read.get(labels)
            if last is not None and now - last < STAGE_MEMORY_EVERY_S:
                return
            _memory_read[labels] = now
        record = job.stage_record(stage_id)
        metrics.record_engine_memory(job.pipeline, stage_id, record.engine)
    except Exception:  # metrics never fail a stage
        log.debug("engine memory not recorded", exc_info=True)
