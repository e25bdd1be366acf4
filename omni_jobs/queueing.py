"""Celery configuration as plain data, so the API (producer) and the workers (consumers) agree.

The core does not import Celery; both shells build their app from this dict. JSON only, acks
late, reject on worker lost, one task prefetched at a time, events on for Flower.
"""

from __future__ import annotations

from typing import Any

from omni_jobs.dispatch import (
    ASSEMBLE_RESULTS_TASK,
    CLEANUP_TASK,
    DELIVER_WEBHOOK_TASK,
    RESULTS_QUEUE,
    WEBHOOKS_QUEUE,
)
from omni_jobs.settings import Settings


def celery_config(settings: Settings) -> dict[str, Any]:
    return {
        "broker_url": settings.effective_broker_url,
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
        "worker_send_task_events": True,
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
            "visibility_timeout": settings.visibility_timeout_s,
            # Prompt redelivery after a worker dies (FACTS.md: default sweep waits ~100 s).
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        "worker_hijack_root_logger": False,
    }
