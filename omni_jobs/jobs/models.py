"""The Job object: one shape for the store, GET, lists, SSE events, webhooks and the client.

Fields may be added; renaming one breaks clients (DESIGN.md), so names are settled here once.
"""

from __future__ import annotations

import secrets
import time
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SkipValidation

from omni_jobs.artifacts.refs import ArtifactRef
from omni_jobs.core.json_types import JsonObject, JsonScalar, JsonValue


def now() -> float:
    """Wall-clock time in seconds since the epoch; every timestamp in a job uses it."""
    return time.time()


def new_job_id() -> str:
    return "job_" + secrets.token_hex(12)


def new_message_id() -> str:
    """A webhook message id (its ``webhook-id``): one per message, the same for all its attempts."""
    return "msg_" + secrets.token_hex(12)


class JobStatus(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    canceled = "canceled"

    @property
    def is_final(self) -> bool:
        return self in FINAL_STATUSES


FINAL_STATUSES = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.canceled})


class Priority(StrEnum):
    """How soon a job's waiting stages start, against the same tenant's other jobs (docs/scaling.md)."""

    low = "low"
    normal = "normal"
    high = "high"


class StageStatus(StrEnum):
    pending = "pending"
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    canceled = "canceled"


class EventType(StrEnum):
    """Every entry of a job's event stream (SSE ``event:``), and so every change a client can see."""

    job_queued = "job.queued"
    job_running = "job.running"
    job_succeeded = "job.succeeded"
    job_failed = "job.failed"
    job_canceled = "job.canceled"
    stage_queued = "stage.queued"
    stage_started = "stage.started"
    stage_progress = "stage.progress"
    stage_succeeded = "stage.succeeded"
    stage_retrying = "stage.retrying"
    """The attempt hit a transient error (store down); the next attempt is queued after a backoff."""
    stage_requeued = "stage.requeued"
    """The attempt's worker stopped renewing its lease (killed, lost); the next attempt is queued now."""
    output_delta = "output.delta"
    """A running AR stage's newly generated text: ``{stage, output, text, index}``."""
    output_preview = "output.preview"
    """A running DiT stage's low-cost look at its current latents: ``{stage, step, total, media_type, data}``."""


FINAL_EVENTS = frozenset({EventType.job_succeeded, EventType.job_failed, EventType.job_canceled})


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Progress(Model):
    stage: str
    step: int
    total: int
    unit: str = Field("steps", description="'steps' for diffusion, 'tokens' for AR stages.")


class StageRecord(Model):
    """What happened to one stage of one job."""

    id: str
    engine: str
    queue: str
    status: StageStatus = StageStatus.pending
    queued_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None
    attempts: int = 0
    outputs: dict[str, ArtifactRef] = Field(default_factory=dict)
    metrics: dict[str, float] = Field(default_factory=dict, description="Stage timings, e.g. engine_s.")
    lease_owner: str | None = Field(None, exclude=True)
    """Which worker process holds the running attempt (internal: fencing, never shown)."""
    lease_until: float | None = Field(None, exclude=True)
    """When that lease expires unless renewed (internal: the reaper reads it)."""
    needs: list[str] = Field(default_factory=list, exclude=True)
    """Stages whose outputs this one reads: it is queued once they all succeeded (internal)."""
    streams: list[str] = Field(default_factory=list, exclude=True)
    """Of ``needs``, the stage whose output this one reads while it is written: queued once that one runs."""

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at


class StepSlot(Model):
    """A step that is not a pipeline stage (the results step): its status, attempts and lease."""

    status: StageStatus = StageStatus.pending
    attempts: int = 0
    queued_at: float | None = None
    worker: str | None = None
    lease_owner: str | None = None
    lease_until: float | None = None


class JobOutput(Model):
    """A final output in the job's manifest."""

    name: str
    type: str = Field(description="text | image | audio | latents | ...")
    media_type: str
    size: int
    artifact: ArtifactRef
    width: int | None = None
    height: int | None = None
    duration_s: float | None = None
    sample_rate: int | None = None
    frames: int | None = Field(None, description="For videos: the number of frames.")
    fps: float | None = Field(None, description="For videos: frames per second.")
    shape: list[int] | None = Field(None, description="For tensor outputs (latents, hidden states): the shape.")
    text: str | None = Field(None, description="For text outputs: the text itself.")
    url: str | None = Field(None, description="Download URL (filled in when the job is presented).")


WebhookEventName = Literal["start", "progress", "completed", "preview"]
WEBHOOK_EVENTS: tuple[str, ...] = ("start", "progress", "completed", "preview")
"""Webhook filter values: start = job.running, progress = stage progress/finish, completed = any end,
preview = a DiT stage's output.preview (the job object plus the preview's data)."""
DEFAULT_WEBHOOK_EVENTS: tuple[str, ...] = ("start", "progress", "completed")
"""What a webhook without a filter gets: previews are opt-in (each carries an image)."""


class WebhookDelivery(Model):
    """One attempt to deliver one webhook message (``id`` is its stable webhook-id)."""

    id: str
    event: str = Field(description="start | progress | completed | preview")
    attempt: int
    at: float
    status_code: int | None = None
    error: str | None = None
    duration_s: float | None = None


class JobWebhook(Model):
    """Where the job's webhooks go and what happened to them. The signing secret is never here."""

    url: str
    events: list[str] = Field(default_factory=lambda: list(DEFAULT_WEBHOOK_EVENTS))
    deliveries: list[WebhookDelivery] = Field(default_factory=list)


class JobError(Model):
    stage: str | None = None
    type: str
    message: str


class Job(Model):
    id: str
    pipeline: str
    status: JobStatus = JobStatus.queued
    input: dict[str, SkipValidation[JsonValue]]
    """JSON once stored (an image input is then its artifact record). Its values are not validated:
    a submission holds an image input's raw bytes here until it has stored them (omni_jobs.accept.submission)."""
    params: dict[str, dict[str, JsonScalar]] = Field(default_factory=dict, description="Per-stage parameters in force.")
    stage: str | None = Field(None, description="The stage running now.")
    progress: Progress | None = None
    stages: list[StageRecord]
    outputs: list[JobOutput] = Field(default_factory=list)
    error: JobError | None = None
    created_at: float = Field(default_factory=now)
    started_at: float | None = None
    completed_at: float | None = None
    webhook: JobWebhook | None = None
    deadline_at: float | None = Field(None, description="The job is canceled if it has not finished by then.")
    tenant: str = Field("default", description="Who owns the job (the API key's tenant); only it sees the job.")
    priority: Priority = Field(Priority.normal, description="low | normal | high: the order of the tenant's "
                               "waiting stages (high first; a low one is never passed for more than "
                               "OMNI_PRIORITY_AGING_S by work queued after it).")
    results: StepSlot = Field(default_factory=StepSlot, exclude=True)
    """The results step (internal: it is not a stage of the pipeline)."""

    def clone(self) -> Job:
        """The copy a transition changes (omni_jobs.jobs.state mutates it, the ledger diffs it with the
        original): the job, its stage records and its results slot are copied; the values inside them
        are shared, as the transitions replace them (outputs, metrics, progress, error), never change
        them in place. ``model_copy(deep=True)``, which goes through copy.deepcopy field by field,
        cost ~6x as much (66 vs 11 us for a two-stage job) at every start and end of a stage."""
        return self.model_copy(update={"stages": [record.model_copy() for record in self.stages],
                                       "results": self.results.model_copy()})

    def stage_record(self, stage_id: str) -> StageRecord:
        for record in self.stages:
            if record.id == stage_id:
                return record
        raise KeyError(f"job {self.id} has no stage '{stage_id}'")

    def output(self, name: str) -> JobOutput | None:
        return next((o for o in self.outputs if o.name == name), None)

    def metrics(self) -> dict[str, float | None]:
        """Queue, run and total time, derived from the timestamps (never stored twice)."""
        queue_time = run_time = total = None
        if self.started_at is not None:
            queue_time = self.started_at - self.created_at
        if self.completed_at is not None:
            total = self.completed_at - self.created_at
            if self.started_at is not None:
                run_time = self.completed_at - self.started_at
        return {"queue_time_s": queue_time, "run_time_s": run_time, "total_time_s": total}


WEBHOOK_EVENT_OF: dict[EventType, str] = {
    EventType.job_running: "start",
    EventType.stage_progress: "progress",
    EventType.stage_succeeded: "progress",
    EventType.job_succeeded: "completed",
    EventType.job_failed: "completed",
    EventType.job_canceled: "completed",
    EventType.output_preview: "preview",
}
"""Job event -> the webhook event it sends. Other events (queued, stage.started, ...) send none."""


class JobEvent(Model):
    """One entry of a job's event stream (status change, stage change, progress)."""

    id: str = ""
    job_id: str
    type: EventType | str = Field(union_mode="left_to_right",
                                  description="An EventType; a reader accepts a type it does not know yet "
                                  "(a newer writer's), and shows it as is.")
    at: float = Field(default_factory=now)
    data: JsonObject = Field(default_factory=dict)
