"""How the core hands work to a transport, without knowing which transport it is.

The API and the workers give the core a Dispatcher: the Celery shells send tasks by name (the
names below), the in-process runner calls the step directly. The core never imports Celery.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

RUN_STAGE_TASK = "omni.run_stage"
ASSEMBLE_RESULTS_TASK = "omni.assemble_results"
CLEANUP_TASK = "omni.cleanup"
RESULTS_QUEUE = "results"
DELIVER_WEBHOOK_TASK = "omni.deliver_webhook"
WEBHOOKS_QUEUE = "webhooks"


@dataclass(frozen=True)
class WebhookMessage:
    """One webhook to deliver: its webhook-id (stable across retries) and its event (start|progress|completed)."""

    message_id: str
    event: str


@dataclass(frozen=True)
class NextStep:
    """Work that became runnable: a stage on its queue, the results step (stage_id None), or a
    webhook delivery (``webhook`` set, on the webhooks queue)."""

    job_id: str
    stage_id: str | None
    queue: str
    webhook: WebhookMessage | None = None


class Dispatcher(Protocol):
    def dispatch(self, step: NextStep) -> None: ...


SendTask = Callable[[str, Sequence[Any], str], None]
"""(task name, positional args, queue) -> None; e.g. a wrapper around ``Celery.send_task``."""


class SendTaskDispatcher:
    """Dispatches by task name through a send function (Celery's send_task in the shells)."""

    def __init__(self, send: SendTask) -> None:
        self._send = send

    def dispatch(self, step: NextStep) -> None:
        if step.webhook is not None:
            self._send(DELIVER_WEBHOOK_TASK, [step.job_id, step.webhook.message_id, step.webhook.event], step.queue)
        elif step.stage_id is None:
            self._send(ASSEMBLE_RESULTS_TASK, [step.job_id], step.queue)
        else:
            self._send(RUN_STAGE_TASK, [step.job_id, step.stage_id], step.queue)


def task_subject(name: str, args: Sequence[Any]) -> tuple[str | None, str | None]:
    """(job id, stage) a task works on, from its name and arguments (None where it has none).

    The results step is the stage ``results``; a webhook delivery is ``webhook:<event>``.
    """
    if not args or not isinstance(args[0], str) or not args[0].startswith("job_"):
        return None, None
    if name == RUN_STAGE_TASK and len(args) > 1:
        return args[0], str(args[1])
    if name == ASSEMBLE_RESULTS_TASK:
        return args[0], RESULTS_QUEUE
    if name == DELIVER_WEBHOOK_TASK and len(args) > 2:
        return args[0], f"webhook:{args[2]}"
    return args[0], None


def display_name(name: str, args: Sequence[Any]) -> str:
    """The name Flower and worker logs show: ``omni.run_stage[job_.../dit]``, so a job id finds its tasks."""
    job_id, stage = task_subject(name, args)
    if job_id is None:
        return name
    if stage is None or name == ASSEMBLE_RESULTS_TASK:
        return f"{name}[{job_id}]"
    return f"{name}[{job_id}/{stage}]"
