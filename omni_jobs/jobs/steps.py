"""The steps: the typed messages between processes, and how each travels as a Celery task.

A step is one unit of work a worker takes from a queue: run one attempt of a stage, assemble a
job's results, or make one delivery attempt of a webhook message. Every step names its *slot* (the
thing it works on: a stage of a job, the job's results, a webhook message) and the *attempt* it
is: a worker may start a step only if that attempt is the slot's next one (omni_jobs.jobs.ledger),
so a duplicate or stale message is recognised and skipped, whatever the broker redelivers.

The core never imports Celery: the shells turn a step into a task name and arguments here, and
back. Steps are written to the outbox in the same transaction as the state change that makes
them runnable; a relay publishes them (omni_jobs.dispatch.outbox).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import SupportsIndex, SupportsInt

from omni_jobs.core import jsontext

RUN_STAGE_TASK = "omni.run_stage"
ASSEMBLE_RESULTS_TASK = "omni.assemble_results"
DELIVER_WEBHOOK_TASK = "omni.deliver_webhook"
CLEANUP_TASK = "omni.cleanup"
RESULTS_QUEUE = "results"
WEBHOOKS_QUEUE = "webhooks"

WORKER_QUEUES: dict[str, str] = {"ar": "threads", "dit": "threads", "talker": "threads", "code2wav": "threads",
                                  "results": "solo", "webhooks": "threads"}
"""Queue -> Celery pool. Stage workers run threads: one engine per process, loaded once, vLLM in
single-process mode (VLLM_ENABLE_V1_MULTIPROCESSING=0: no engine-core child to start or lose),
and several jobs in flight whose engine calls the batcher (omni_jobs.engines.batching) turns into one
batch. Webhook deliveries wait on other people's servers, so they run in threads, several at once."""

STAGE_QUEUES = ("ar", "dit", "talker", "code2wav")
"""Queues whose worker runs OMNI_STAGE_MAX_IN_FLIGHT tasks at once (the batch the engine sees). ``talker`` and
``code2wav``: Qwen2.5-Omni's speech stages, each on a queue of its own so that it scales on its own."""


class StepKind(str, Enum):
    run_stage = "run_stage"
    assemble_results = "assemble_results"
    deliver_webhook = "deliver_webhook"


@dataclass(frozen=True, slots=True)
class RunStage:
    """Run attempt ``attempt`` of stage ``stage_id`` of a job, on the stage's queue."""

    job_id: str
    stage_id: str
    attempt: int
    queue: str

    kind = StepKind.run_stage

    @property
    def slot(self) -> str:
        return stage_slot(self.job_id, self.stage_id)


@dataclass(frozen=True, slots=True)
class AssembleResults:
    """Write the job's final files and end it succeeded (the multimodal output processor)."""

    job_id: str
    attempt: int
    queue: str = RESULTS_QUEUE

    kind = StepKind.assemble_results

    @property
    def slot(self) -> str:
        return results_slot(self.job_id)


@dataclass(frozen=True, slots=True)
class DeliverWebhook:
    """One delivery attempt of webhook message ``message_id`` (its webhook-id, stable across attempts)."""

    job_id: str
    message_id: str
    event: str
    attempt: int
    queue: str = WEBHOOKS_QUEUE

    kind = StepKind.deliver_webhook

    @property
    def slot(self) -> str:
        return webhook_slot(self.job_id, self.message_id)


Step = RunStage | AssembleResults | DeliverWebhook


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What running a step did: succeeded | retrying | failed | canceled | lost | discarded | skipped
    (| delivered | gave_up | rejected for webhooks), and why, for the log and the task result."""

    status: str
    detail: str = ""

TASK_OF: dict[StepKind, str] = {
    StepKind.run_stage: RUN_STAGE_TASK,
    StepKind.assemble_results: ASSEMBLE_RESULTS_TASK,
    StepKind.deliver_webhook: DELIVER_WEBHOOK_TASK,
}


# --- slots: what a lease, a queue index entry and an outbox entry name ---
def stage_slot(job_id: str, stage_id: str) -> str:
    return f"stage:{job_id}:{stage_id}"


def results_slot(job_id: str) -> str:
    return f"results:{job_id}"


def webhook_slot(job_id: str, message_id: str) -> str:
    return f"webhook:{job_id}:{message_id}"


@dataclass(frozen=True, slots=True)
class Slot:
    """A parsed slot name: its kind, job, and the stage id or webhook message id (None for results)."""

    kind: StepKind
    job_id: str
    name: str | None


def parse_slot(slot: str) -> Slot:
    head, _, rest = slot.partition(":")
    job_id, _, name = rest.partition(":")
    kinds = {"stage": StepKind.run_stage, "results": StepKind.assemble_results, "webhook": StepKind.deliver_webhook}
    if head not in kinds or not job_id.startswith("job_") or (head != "results") != bool(name):
        raise ValueError(f"not a step slot: {slot!r}")
    return Slot(kinds[head], job_id, name or None)


def step_id(step: Step) -> str:
    """Unique per (slot, attempt): the outbox entry id and the Celery task id of the step."""
    return f"{step.slot}:{step.attempt}"


# --- the wire: JSON for the outbox, task name + positional arguments for Celery ---
def to_json(step: Step) -> str:
    fields: dict[str, str | int] = {"kind": step.kind.value, "job_id": step.job_id, "attempt": step.attempt,
                                    "queue": step.queue}
    if isinstance(step, RunStage):
        fields["stage_id"] = step.stage_id
    elif isinstance(step, DeliverWebhook):
        fields["message_id"] = step.message_id
        fields["event"] = step.event
    return jsontext.dumps(fields)


def from_json(raw: str | bytes) -> Step:
    fields = jsontext.loads(raw)
    kind = StepKind(fields.pop("kind"))
    if kind is StepKind.run_stage:
        return RunStage(**fields)
    if kind is StepKind.assemble_results:
        return AssembleResults(**fields)
    return DeliverWebhook(**fields)


def task_args(step: Step) -> list[str | int]:
    """Positional task arguments: readable in Flower (job id first), enough to rebuild the step."""
    if isinstance(step, RunStage):
        return [step.job_id, step.stage_id, step.attempt]
    if isinstance(step, AssembleResults):
        return [step.job_id, step.attempt]
    return [step.job_id, step.message_id, step.event, step.attempt]


def _attempt(arg: object) -> int:
    """A task message's attempt argument as an int (``int()`` of it, as it came off the wire)."""
    if isinstance(arg, (str, bytes, SupportsInt, SupportsIndex)):
        return int(arg)
    raise TypeError(f"a task's attempt is a number, got {type(arg).__name__}")


def from_task(name: str, args: Sequence[object], queue: str) -> Step:
    """The step a task message carries (the inverse of TASK_OF + task_args)."""
    if name == RUN_STAGE_TASK:
        return RunStage(str(args[0]), str(args[1]), _attempt(args[2]), queue)
    if name == ASSEMBLE_RESULTS_TASK:
        return AssembleResults(str(args[0]), _attempt(args[1]), queue)
    if name == DELIVER_WEBHOOK_TASK:
        return DeliverWebhook(str(args[0]), str(args[1]), str(args[2]), _attempt(args[3]), queue)
    raise ValueError(f"not a step task: {name}")


def task_subject(name: str, args: Sequence[object]) -> tuple[str | None, str | None]:
    """(job id, stage) a task works on, for log context: the results step is the stage ``results``,
    a webhook delivery ``webhook:<event>``."""
    job_id = args[0] if args else None
    if not isinstance(job_id, str) or not job_id.startswith("job_"):
        return None, None
    if name == RUN_STAGE_TASK and len(args) > 1:
        return job_id, str(args[1])
    if name == ASSEMBLE_RESULTS_TASK:
        return job_id, RESULTS_QUEUE
    if name == DELIVER_WEBHOOK_TASK and len(args) > 2:
        return job_id, f"webhook:{args[2]}"
    return job_id, None


def display_name(name: str, args: Sequence[object]) -> str:
    """The name Flower and worker logs show: ``omni.run_stage[job_.../dit#2]``, so a job id finds its tasks."""
    job_id, stage = task_subject(name, args)
    if job_id is None:
        return name
    attempt = f"#{args[-1]}" if args and isinstance(args[-1], int) else ""
    if stage is None or name == ASSEMBLE_RESULTS_TASK:
        return f"{name}[{job_id}{attempt}]"
    return f"{name}[{job_id}/{stage}{attempt}]"
