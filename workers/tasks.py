"""Celery tasks: one per kind of step, each a few lines around the core's StepExecutor.

The core decides everything (omni_jobs.jobs.ledger): which attempt may run, what a failure means,
when a retry is due. Retries are new attempts dispatched through the outbox with their backoff, not
Celery retries, so nothing waits in a worker's memory for a countdown. A task that could not even
record its step's start (Redis unreachable for OMNI_STORE_WAIT_S) gives the message back to the
broker instead of dropping it.

Every worker process also runs the outbox relay (publishing what its commits dispatch), the lease
keeper (renewing its running steps' leases) and the reaper (taking back dead workers' steps); a
results worker also runs the batch driver (omni_jobs.accept.batches).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from functools import lru_cache, partial
from typing import Any

from celery import Task, signals
from celery.exceptions import Reject

from omni_jobs.accept.batches import BatchDriver
from omni_jobs.core.collector import freeze_loaded_objects
from omni_jobs.core.errors import StoreUnavailable
from omni_jobs.core.settings import get_settings
from omni_jobs.dispatch.queue_depth import queue_depth
from omni_jobs.dispatch.queueing import SNAPSHOT_HEADER, job_snapshot, publish_steps
from omni_jobs.dispatch.retention import cleanup
from omni_jobs.dispatch.worker_registry import NodeClaim, claim_node, release_node, start_heartbeat, unregister_worker
from omni_jobs.engines.batching import arrivals
from omni_jobs.engines.gloo_device import destroy_process_groups
from omni_jobs.engines.stage_exec import load_stage_engine
from omni_jobs.jobs.steps import (
    ASSEMBLE_RESULTS_TASK,
    CLEANUP_TASK,
    DELIVER_WEBHOOK_TASK,
    RESULTS_QUEUE,
    RUN_STAGE_TASK,
    Step,
    StepKind,
    display_name,
    from_task,
)
from omni_jobs.pipelines.model_source import load_model_sources
from omni_jobs.report import metrics, usage
from omni_jobs.runtime import Runtime
from workers import observability, startup
from workers.app import ENGINE_MALLOC, app

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def runtime() -> Runtime:
    """One Runtime per worker process: engines load on first use and stay loaded."""
    settings = get_settings()
    load_model_sources(settings.model_sources)  # tiny:NAME ids resolve (and build on first use)
    metrics.install()  # already done at worker_init; again for a process that runs tasks without it
    rt = Runtime(settings, hard_time_limits=True)  # a stage past its hard limit ends this process
    rt.relay(partial(publish_steps, app))  # this process publishes what its commits dispatch
    usage.install(rt.redis)  # usage per tenant: what this process's commits end or run
    return rt


def _execute(task: Task, name: str, args: Sequence[Any]) -> str:
    rt = runtime()
    step: Step = from_task(name, args, str(task.request.delivery_info.get("routing_key") or ""))
    worker = str(task.request.hostname)
    if rt.worker != worker:
        rt.set_worker(worker)
    snapshot = job_snapshot(getattr(task.request, SNAPSHOT_HEADER, None), step.job_id)
    try:
        outcome = rt.executor.execute(step, worker=worker, owner=rt.owner, snapshot=snapshot)
    except StoreUnavailable as exc:
        # Nothing was recorded (or the lease will expire and the reaper takes the step back): keep
        # the message for another try rather than acknowledge work that did not happen.
        log.error("%s; giving the message back to the broker", exc)
        raise Reject(str(exc), requeue=True) from exc
    if step.kind is StepKind.run_stage and outcome.status in ("succeeded", "failed"):
        observability.record_stage_memory(rt, step.job_id, getattr(step, "stage_id", ""), snapshot)
    if step.kind is StepKind.deliver_webhook:
        metrics.webhook_delivery(getattr(step, "event", ""), outcome.status)
    if outcome.status == "skipped":
        log.info("%s: skipped: %s", display_name(name, args), outcome.detail)
    return outcome.status


@app.task(name=RUN_STAGE_TASK, bind=True, acks_late=True)
def run_stage(self: Task, job_id: str, stage_id: str, attempt: int) -> str:
    with arrivals.task(str(self.request.id)):  # arriving until its engine request reaches the batcher
        return _execute(self, RUN_STAGE_TASK, [job_id, stage_id, attempt])


@signals.task_received.connect
def on_task_received(request: Any = None, **_: Any) -> None:
    """A stage task the consumer took: on its way to the batcher (batch filling, omni_jobs.engines.batching)."""
    if request is not None and getattr(request, "name", None) == RUN_STAGE_TASK:
        arrivals.received(str(request.id))


@app.task(name=ASSEMBLE_RESULTS_TASK, bind=True, acks_late=True)
def assemble_results(self: Task, job_id: str, attempt: int) -> str:
    return _execute(self, ASSEMBLE_RESULTS_TASK, [job_id, attempt])


@app.task(name=DELIVER_WEBHOOK_TASK, bind=True, acks_late=True)
def deliver_webhook(self: Task, job_id: str, message_id: str, event: str, attempt: int) -> str:
    return _execute(self, DELIVER_WEBHOOK_TASK, [job_id, message_id, event, attempt])


@app.task(name=CLEANUP_TASK)
def run_cleanup() -> dict[str, int]:
    """Periodic retention and a reaper pass (scheduled by ``celery beat``; see omni_jobs.dispatch.queueing)."""
    rt = runtime()
    s = rt.settings
    report = cleanup(rt.ledger, rt.artifacts, output_ttl_s=s.output_ttl_s, intermediate_ttl_s=s.intermediate_ttl_s,
                     reaper=rt.reaper)
    return dict(report.__dict__)


@signals.worker_init.connect
def on_worker_init(sender: Any = None, **_: Any) -> None:
    """Before the broker is touched: refuse to start when an engine library is out of its range."""
    if sender is None:
        return
    startup.check_versions(str(sender.hostname), runtime().catalogue, startup.consumed_queues(sender), get_settings())


@signals.worker_ready.connect
def on_worker_ready(sender: Any = None, **_: Any) -> None:
    """Take back what this node's previous process held, preload the engines, then announce the
    worker (readiness means: can serve at once) and start its relay and reaper.

    A model that cannot load stops the worker here (see workers.startup and OMNI_REFUSE_BROKEN_MODELS).
    """
    if sender is None:
        return
    name = str(sender.hostname)
    rt = runtime()
    rt.set_worker(name)
    claim = claim_node(rt.redis, name)  # one live process per name: else the next line takes a live one's steps
    if isinstance(claim, str):
        startup.refuse(name, [claim])
    assert isinstance(claim, NodeClaim)
    _heartbeat["claim"] = claim
    rt.reaper.reclaim_node(name, rt.owner)  # a restarted worker's predecessor died holding these
    queues = sorted(q.name for q in sender.task_consumer.queues)
    settings = get_settings()
    log.info("engines' malloc: %s (OMNI_ENGINE_MALLOC=%s)", ENGINE_MALLOC, settings.engine_malloc)
    if settings.preload_engines:
        startup.check_models(name, preload_engines(set(queues)), settings)
        if settings.freeze_engine_objects:
            freeze_loaded_objects()  # before the first task: the collector's full passes skip the engines
    rt.relay(partial(publish_steps, app)).start()
    rt.reaper.start()
    if RESULTS_QUEUE in queues:  # the results workers advance the batches (omni_jobs.accept.batches)
        batch_driver(rt).start()
    concurrency = worker_concurrency(sender)  # the scheduler's window counts it
    configure_batch_filling(rt, queues, concurrency)
    _heartbeat["stop"] = start_heartbeat(rt.redis, name, queues, concurrency, rt.settings.engine_cpus, claim)
    _heartbeat["name"] = name


@signals.worker_shutdown.connect
def on_worker_shutdown(**_: Any) -> None:
    stop = _heartbeat.get("stop")
    if isinstance(stop, threading.Event):
        stop.set()
        unregister_worker(runtime().redis, str(_heartbeat["name"]))
    claim = _heartbeat.get("claim")
    if isinstance(claim, NodeClaim):
        release_node(runtime().redis, claim)  # its next process starts at once, wherever it runs
    destroy_process_groups()  # the AR engine's gloo groups, before the interpreter's teardown


_heartbeat: dict[str, object] = {}


def batch_driver(rt: Runtime) -> BatchDriver:
    """This process's batch driver (a daemon thread once started)."""
    return rt.batch_driver


def worker_concurrency(consumer: Any) -> int:
    """Tasks this worker runs at once. worker_ready's sender is the Consumer, which has no
    ``concurrency`` of its own: read its WorkController's (or its pool's limit). Reading the consumer
    alone gave 1, so the scheduler's window let out 3 tasks at a time to a -c 64 stage worker."""
    for value in (getattr(getattr(consumer, "controller", None), "concurrency", None),
                  getattr(getattr(consumer, "pool", None), "limit", None),
                  getattr(consumer, "concurrency", None)):
        if isinstance(value, int) and value > 0:
            return value
    return 1


def configure_batch_filling(rt: Runtime, queues: Sequence[str], concurrency: int) -> None:
    """A starting batch with room left waits (OMNI_BATCH_FILL_WAIT_MS at most) for the stage tasks this
    worker has received, and for the messages waiting in its queues that its free slots will take."""
    broker = rt.broker_redis

    def depth() -> int:
        return sum(queue_depth(broker, q) for q in queues)

    arrivals.configure(rt.settings.batch_fill_wait_ms, probe=depth, capacity=concurrency)


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
