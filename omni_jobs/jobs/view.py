"""The public JSON of a job: the stored Job plus what is derived at read time (URLs, metrics).

Presigned URLs expire, so they are made when a job is shown, never stored. API responses, SSE
and webhooks all use this one function so that clients see one shape, and :class:`JobView` is
that shape as a model: the ``response_model`` of every job route (so the OpenAPI spec describes
it), the ``job`` of webhook bodies and of SSE final events, and what ``omni_jobs.client`` parses.

:func:`present_job` builds the JSON as a plain dict (the hot path: one ``model_dump``, no second
validation); ``JobView.model_validate(present_job(...))`` holds for every job, which the tests
check with ``extra="forbid"`` on each job JSON they see.

The models import nothing but pydantic and the job models (the artifact store is a type here,
never imported at run time), so the HTTP client can use them without the storage layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from omni_jobs.artifacts.refs import ArtifactRef
from omni_jobs.core.json_types import JsonObject
from omni_jobs.jobs.models import (
    FINAL_EVENTS,
    Job,
    JobError,
    JobStatus,
    Priority,
    Progress,
    StageStatus,
    WebhookDelivery,
)

if TYPE_CHECKING:
    from omni_jobs.artifacts.store import ArtifactStore

_LENIENT = ConfigDict(extra="ignore")
"""Clients parse with extra fields ignored, at every level: a newer server may add some. Tests
forbid them instead (tests/e2e/job_contract.py)."""


class _View(BaseModel):
    model_config = _LENIENT


class ArtifactRefView(ArtifactRef):
    """Where a stage output is stored (an ArtifactRef, read leniently)."""

    model_config = _LENIENT


class ProgressView(Progress):
    """The running stage's progress (steps for diffusion, tokens for AR stages)."""

    model_config = _LENIENT


class JobErrorView(JobError):
    """Why the job failed: the stage (when one failed), the error's type and its message."""

    model_config = _LENIENT


class WebhookDeliveryView(WebhookDelivery):
    """One attempt to deliver one webhook message."""

    model_config = _LENIENT


class WebhookView(_View):
    """Where the job's webhooks go and what happened to them (the signing secret is never here)."""

    url: str
    events: list[str] = Field(description="Which events send it: start, progress, completed, preview.")
    deliveries: list[WebhookDeliveryView]


class StageView(_View):
    """One stage of the job as shown: its record plus derived times."""

    id: str
    engine: str
    queue: str
    status: StageStatus
    queued_at: float | None
    started_at: float | None
    finished_at: float | None
    worker: str | None
    attempts: int
    outputs: dict[str, ArtifactRefView] = Field(description="The stage's output ports and where each is stored.")
    metrics: dict[str, float] = Field(description="Stage timings, e.g. engine_s.")
    duration_s: float | None = Field(description="finished_at - started_at, once both are known.")
    wait_s: float | None = Field(description="started_at - queued_at: how long the stage waited for a worker.")


class OutputView(_View):
    """A final output. Optional fields are absent (not null) when they do not apply."""

    name: str
    type: str = Field(description="text | image | audio | video | latents | ...")
    media_type: str
    size: int
    url: str = Field(description="Where to download it: a presigned URL, or GET /v1/jobs/{id}/outputs/{name}.")
    width: int | None = None
    height: int | None = None
    duration_s: float | None = None
    sample_rate: int | None = None
    frames: int | None = Field(None, description="For videos: the number of frames.")
    fps: float | None = Field(None, description="For videos: frames per second.")
    shape: list[int] | None = Field(None, description="For tensor outputs (latents, hidden states): the shape.")
    text: str | None = Field(None, description="For text outputs: the text itself.")


class JobMetrics(_View):
    queue_time_s: float | None = Field(description="started_at - created_at.")
    run_time_s: float | None = Field(description="completed_at - started_at.")
    total_time_s: float | None = Field(description="completed_at - created_at.")


class JobUrls(_View):
    get: str
    cancel: str
    events: str = Field(description="The job's Server-Sent Events.")


class JobView(_View):
    """The job object: what GET /v1/jobs/{id}, lists, SSE final events and webhooks carry."""

    id: str = Field(examples=["job_5f0c2a9e1b7d4c3a8e6f0b1d"])
    pipeline: str
    status: JobStatus
    input: JsonObject
    params: dict[str, JsonObject] = Field(description="Per-stage parameters in force.")
    stage: str | None = Field(description="The stage running now.")
    progress: ProgressView | None
    stages: list[StageView]
    outputs: list[OutputView]
    error: JobErrorView | None
    created_at: float
    started_at: float | None
    completed_at: float | None
    webhook: WebhookView | None
    deadline_at: float | None = Field(description="The job is canceled if it has not finished by then.")
    tenant: str = Field(description="Who owns the job (the API key's tenant); only it sees the job.")
    priority: Priority
    metrics: JobMetrics
    queue_position: int | None = Field(description="1-based place of the job's waiting stage on its queue, "
                                       "when known (GET and submit answers); null once running or in lists.")
    urls: JobUrls

    @property
    def is_final(self) -> bool:
        """True once the job succeeded, failed or was canceled: nothing about it changes after that."""
        return self.status.is_final

    def output(self, name: str) -> OutputView | None:
        """The final output called ``name``, if the job has one."""
        return next((o for o in self.outputs if o.name == name), None)


class JobListView(_View):
    """A page of jobs, newest first (GET /v1/jobs)."""

    data: list[JobView]
    next_cursor: str | None = Field(None, description="Pass as ?cursor= to get the next page.")


class JobEventView(_View):
    """One event of a job's Server-Sent Events (GET /v1/jobs/{id}/events): a stored JobEvent, and on
    the final event (job.succeeded, job.failed, job.canceled) the job as it ended."""

    id: str = Field("", description="The stream id: send it back as Last-Event-ID to resume after this event.")
    job_id: str
    type: str = Field(description="job.queued, stage.started, stage.progress, output.delta, job.succeeded, ...")
    at: float
    data: JsonObject = Field(default_factory=dict)
    job: JobView | None = Field(None, description="On the final event only: the job as it ended.")

    @property
    def is_final(self) -> bool:
        """True for the event that ends the stream: the job succeeded, failed or was canceled."""
        return self.type in FINAL_EVENTS


JobJSON = JsonObject
"""A job as JSON: what :func:`present_job` returns, and what :class:`JobView` describes."""


def job_urls(job_id: str, public_url: str) -> dict[str, str]:
    base = f"{public_url.rstrip('/')}/v1/jobs/{job_id}"
    return {"get": base, "cancel": f"{base}/cancel", "events": f"{base}/events"}


def output_url(job: Job, name: str, *, public_url: str, artifacts: ArtifactStore, presign: bool = True) -> str:
    """A presigned URL where the store has them (S3) and they are wanted, else the API's download route."""
    out = job.output(name)
    if out is not None and presign:
        presigned = artifacts.url(out.artifact, filename=out.artifact.key.rsplit("/", 1)[-1])
        if presigned:
            return presigned
    return f"{public_url.rstrip('/')}/v1/jobs/{job.id}/outputs/{name}"


def present_job(job: Job, *, public_url: str, artifacts: ArtifactStore, presign: bool = True,
                queue_position: int | None = None) -> JobJSON:
    """``queue_position``: 1-based place of the job's waiting stage on its queue, when the caller knows it."""
    data = job.model_dump(mode="json")
    data["metrics"] = job.metrics()
    data["queue_position"] = queue_position
    for stage in data["stages"]:
        record = job.stage_record(stage["id"])
        stage["duration_s"] = record.duration_s
        stage["wait_s"] = (record.started_at - record.queued_at
                           if record.started_at is not None and record.queued_at is not None else None)
    data["outputs"] = []
    for out in job.outputs:
        entry = out.model_dump(mode="json", exclude={"artifact"}, exclude_none=True)
        entry["url"] = output_url(job, out.name, public_url=public_url, artifacts=artifacts, presign=presign)
        data["outputs"].append(entry)
    data["urls"] = job_urls(job.id, public_url)
    return data
