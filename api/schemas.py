"""Request and response bodies of the HTTP API (the wire shapes, in one place)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class JobRequest(BaseModel):
    """POST /v1/jobs."""

    model_config = ConfigDict(extra="forbid")

    pipeline: str = Field(min_length=1, max_length=100, examples=["text-to-image"])
    input: dict[str, Any] = Field(examples=[{"prompt": "a red fox in the snow"}])
    params: dict[str, dict[str, Any]] | None = Field(
        None, description="Per-stage overrides keyed by stage id, e.g. {'dit': {'seed': 7, 'height': 64}}."
    )
    webhook: str | None = Field(
        None, max_length=2048, description="http(s) URL that receives the job (signed, Standard Webhooks) as it changes.",
        examples=["https://example.com/hooks/omni"],
    )
    priority: Literal["low", "normal", "high"] = Field(
        "normal", description="The order of this tenant's waiting stages: high ones start first; a low one waits "
        "at most OMNI_PRIORITY_AGING_S behind normal work queued after it. Tenants take turns whatever it is.",
    )
    webhook_events_filter: list[Literal["start", "progress", "completed", "preview"]] | None = Field(
        None, min_length=1,
        description="Which events send the webhook: start (job running), progress (stage steps/ends, throttled), "
        "completed (succeeded, failed or canceled), preview (a DiT stage's latent preview, throttled; the body "
        "adds 'preview': {stage, step, total, media_type, width, height, data}). Default: start, progress, "
        "completed.",
    )


class JobList(BaseModel):
    data: list[dict[str, Any]]
    next_cursor: str | None = Field(None, description="Pass as ?cursor= to get the next page.")


class PipelineInfo(BaseModel):
    name: str
    description: str
    inputs: dict[str, Any]
    stages: list[dict[str, Any]]
    outputs: list[dict[str, Any]]


class ErrorBody(BaseModel):
    detail: Any
