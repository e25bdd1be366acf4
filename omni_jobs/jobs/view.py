"""The public JSON of a job: the stored Job plus what is derived at read time (URLs, metrics).

Presigned URLs expire, so they are made when a job is shown, never stored. API responses, SSE
and webhooks all use this one function so that clients see one shape.
"""

from __future__ import annotations

from typing import Any

from omni_jobs.artifacts import ArtifactStore
from omni_jobs.jobs.models import Job


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
                queue_position: int | None = None) -> dict[str, Any]:
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
