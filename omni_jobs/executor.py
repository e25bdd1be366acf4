"""The one executor: runs a step, whatever brought it (a Celery task, or the in-process runner).

Routing lives here and nowhere else: a RunStage goes to the StageRunner, an AssembleResults to
the ResultsAssembler, a DeliverWebhook to the WebhookDeliverer. Each takes the step's lease
first, so a duplicate or stale message does nothing (``skipped``).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from omni_jobs.jobs.models import Job
from omni_jobs.jobs.steps import AssembleResults, DeliverWebhook, RunStage, Step, StepOutcome
from omni_jobs.report.results import ResultsAssembler
from omni_jobs.report.webhooks import WebhookDeliverer
from omni_jobs.run.stages import StageRunner


@dataclass
class StepExecutor:
    stages: StageRunner
    results: ResultsAssembler
    webhooks: WebhookDeliverer | None = None

    def execute(self, step: Step, *, worker: str, owner: str, snapshot: Job | None = None) -> StepOutcome:
        """``worker``: the name shown on the job (e.g. ``dit@host``); ``owner``: this process's lease owner;
        ``snapshot``: the job as a stage's task message carried it (StageRunner.run).

        Each execution holds its lease under its own token, so the same message delivered twice to
        one process (after a visibility timeout) is refused like any duplicate, while a retried
        write of this execution is recognised as its own."""
        owner = f"{owner}/{secrets.token_hex(4)}"
        if isinstance(step, RunStage):
            return self.stages.run(step, worker=worker, owner=owner, snapshot=snapshot)
        if isinstance(step, AssembleResults):
            return self.results.run(step, worker=worker, owner=owner)
        if isinstance(step, DeliverWebhook):
            if self.webhooks is None:
                return StepOutcome("skipped", "this process delivers no webhooks")
            return self.webhooks.run(step, worker=worker, owner=owner)
        raise TypeError(f"not a step: {step!r}")
