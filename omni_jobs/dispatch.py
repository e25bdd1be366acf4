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
RESULTS_QUEUE = "results"


@dataclass(frozen=True)
class NextStep:
    """Work that became runnable: a stage on its queue, or the results step (stage_id None)."""

    job_id: str
    stage_id: str | None
    queue: str


class Dispatcher(Protocol):
    def dispatch(self, step: NextStep) -> None: ...


SendTask = Callable[[str, Sequence[Any], str], None]
"""(task name, positional args, queue) -> None; e.g. a wrapper around ``Celery.send_task``."""


class SendTaskDispatcher:
    """Dispatches by task name through a send function (Celery's send_task in the shells)."""

    def __init__(self, send: SendTask) -> None:
        self._send = send

    def dispatch(self, step: NextStep) -> None:
        if step.stage_id is None:
            self._send(ASSEMBLE_RESULTS_TASK, [step.job_id], step.queue)
        else:
            self._send(RUN_STAGE_TASK, [step.job_id, step.stage_id], step.queue)
