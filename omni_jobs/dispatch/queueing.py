"""Celery configuration as plain data, so the API (producer) and the workers (consumers) agree.

The core does not import Celery; both shells build their app from this dict. JSON only, acks
late (a worker holds no more messages than it runs: what a killed worker held comes back through
the reaper, see omni_jobs.dispatch.leases), reject on worker lost, one task prefetched per slot, task events
once Flower asks for them (OMNI_WORKER_TASK_EVENTS: from the start). The broker's visibility
timeout is only a last resort: leases decide who runs a step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from omni_jobs.core.redis_url import kombu_broker
from omni_jobs.core.settings import Settings
from omni_jobs.jobs import codec
from omni_jobs.jobs.models import Job
from omni_jobs.jobs.steps import (
    ASSEMBLE_RESULTS_TASK,
    CLEANUP_TASK,
    DELIVER_WEBHOOK_TASK,
    RESULTS_QUEUE,
    TASK_OF,
    WEBHOOKS_QUEUE,
    AssembleResults,
    DeliverWebhook,
    RunStage,
    Step,
    display_name,
    task_args,
)

log = logging.getLogger(__name__)


def celery_config(settings: Settings) -> dict[str, object]:
    # a sentinel:// URL is spelled as kombu's Sentinel transport takes it, with its master_name (and TLS)
    broker = kombu_broker(settings.effective_broker_url,
                          "OMNI_BROKER_URL" if settings.broker_url else "OMNI_REDIS_URL")
    sentinel_options = broker.pop("broker_transport_options", {})
    assert isinstance(sentinel_options, dict)
    return {
        **broker,
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "worker_send_task_events": settings.worker_task_events,  # else only once Flower asks
        "task_send_sent_event": True,
        "task_default_queue": RESULTS_QUEUE,
        "task_routes": {ASSEMBLE_RESULTS_TASK: {"queue": RESULTS_QUEUE}, CLEANUP_TASK: {"queue": RESULTS_QUEUE},
                        DELIVER_WEBHOOK_TASK: {"queue": WEBHOOKS_QUEUE}},
        # Retention runs from `celery -A workers.app:app beat` (compose runs one); every run is idempotent.
        "beat_schedule": {
            "omni-cleanup": {"task": CLEANUP_TASK, "schedule": float(settings.cleanup_interval_s)},
        },
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            # No copy of a taken message in Redis (kombu's unacked hash): the job store already knows
            # every step that went out and not started, and the reaper publishes it again when its
            # message was lost, or its worker died holding it (omni_jobs.dispatch.leases.Reaper). kombu's copy
            # came back only after the visibility timeout, an hour, and cost two writes per task (on
            # taking and on acknowledging it), each fsynced with a durable Redis: ~1.8 ms of every hop
            # (bench --hops). A warm shutdown still hands back what the worker held (in memory).
            "ack_emulation": False,
            **sentinel_options,
        },
        "worker_hijack_root_logger": False,
    }


class TaskPublisher(Protocol):
    """What publishing needs of a Celery app (the core does not import Celery)."""

    def producer_or_acquire(self) -> AbstractContextManager[object]: ...

    def send_task(self, name: str, *, args: Sequence[object], queue: str, task_id: str, shadow: str,
                  producer: object) -> object: ...


def publish_steps(app: TaskPublisher, steps: Sequence[Step], ids: Sequence[str]) -> None:
    """Publish steps as tasks through a Celery app (given by the shell), over one producer connection.

    The task id is the outbox entry id, so a re-published duplicate shows under the same id in
    Flower; the display name (``shadow``) contains the job id: omni.run_stage[job_.../ar#1].
    """
    with app.producer_or_acquire() as producer:
        for step, task_id in zip(steps, ids, strict=True):
            name, args = TASK_OF[step.kind], task_args(step)
            app.send_task(name, args=args, queue=step.queue, task_id=task_id, shadow=display_name(name, args),
                          producer=producer)


_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def broker_message(step: Step, task_id: str, extra_headers: dict[str, object] | None = None) -> str:
    """The task message of ``step`` as kombu's Redis transport keeps it on the queue's list: Celery's
    message protocol 2, JSON, what ``publish_steps`` would write (minus the base64 body encoding,
    which kombu reads as optional). ``task_id`` is the outbox entry id: the task id, and the
    delivery tag kombu's unacked set keys by (one message per entry: each is published once).

    A store whose Redis is also the broker renders the same message inside its scripts, from
    ``broker_message_templates``, when it pushes a step onto its queue (RedisJobStore)."""
    name, args = TASK_OF[step.kind], task_args(step)
    headers: dict[str, object] = {
        "lang": "py", "task": name, "id": task_id, "shadow": display_name(name, args), "eta": None, "expires": None,
        "group": None, "group_index": None, "retries": 0, "timelimit": [None, None], "root_id": task_id,
        "parent_id": None, "argsrepr": repr(args), "kwargsrepr": "{}", "origin": "omni-jobs", "ignore_result": None,
        "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {}, **(extra_headers or {}),
    }
    properties = {
        "correlation_id": task_id, "reply_to": "", "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": step.queue}, "priority": 0, "delivery_tag": task_id,
    }
    body = json.dumps([args, {}, _EMBED], separators=(",", ":"))
    return json.dumps({"body": body, "content-encoding": "utf-8", "content-type": "application/json",
                       "headers": headers, "properties": properties}, separators=(",", ":"))


_ATTEMPT, _JOB = 7070707, "job_SAMPLE"  # stand for a step's attempt (a number) and job id while templates render
SNAPSHOT_HEADER = "omni_job"
"""The header of a run_stage message that carries its job as the store pushed it (``job_snapshot``)."""


def broker_message_templates() -> dict[str, str]:
    """Step kind -> ``broker_message`` with ``@@NAME@@`` where each step's values go: ID (the entry
    id), JOB, ATTEMPT, QUEUE, STAGE (run_stage), MSG and EVENT (deliver_webhook). A script fills
    them in with plain text, so only values of letters, digits and ``_.:#/-`` may go in (ids,
    stage and queue names, event names are): anything else is published by the relay through kombu.

    A run_stage message also has the ``SNAPSHOT_HEADER``, where the script puts the job as it is when
    the message is pushed: the worker starts the stage from it without reading the job first."""
    samples: list[Step] = [RunStage(_JOB, "@@STAGE@@", _ATTEMPT, "@@QUEUE@@"),
                           AssembleResults(_JOB, _ATTEMPT, "@@QUEUE@@"),
                           DeliverWebhook(_JOB, "@@MSG@@", "@@EVENT@@", _ATTEMPT, "@@QUEUE@@")]
    snapshot: dict[str, object] = {SNAPSHOT_HEADER: "@@SNAPSHOT@@"}
    return {step.kind.value: broker_message(step, "@@ID@@", snapshot if isinstance(step, RunStage) else None)
            .replace(str(_ATTEMPT), "@@ATTEMPT@@").replace(_JOB, "@@JOB@@") for step in samples}


def job_snapshot(header: object, job_id: str) -> Job | None:
    """The job a run_stage message carries (``SNAPSHOT_HEADER``: [its hash's fields and values, flat;
    its progress or '']), as the store's script pushed it; None where there is none, or it is not
    ``job_id``'s or not readable (the worker then reads the job). It may be stale by the time the
    stage starts: the start's write is guarded, and a refusal is checked against the stored job."""
    if not isinstance(header, list) or len(header) != 2 or not isinstance(header[0], list):
        return None
    flat, progress = header
    try:
        job = codec.decode(dict(zip(flat[::2], flat[1::2], strict=True)), progress or None)
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("job %s: the snapshot in its task message is unreadable (%s); reading the job", job_id, exc)
        return None
    return job if job is not None and job.id == job_id else None
