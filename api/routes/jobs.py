"""/v1/jobs: submit, list, get, cancel, and download outputs."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response, status

from api.deps import ApiContext, get_context
from api.schemas import JobList, JobRequest
from omni_jobs.artifacts import ArtifactNotFound
from omni_jobs.cancellation import cancel_job
from omni_jobs.errors import JobNotFound
from omni_jobs.jobs.models import Job, JobStatus
from omni_jobs.jobs.view import present_job

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
Ctx = Annotated[ApiContext, Depends(get_context)]


def _present(ctx: ApiContext, job: Job) -> dict[str, Any]:
    settings = ctx.runtime.settings
    return present_job(job, public_url=settings.public_url, artifacts=ctx.runtime.artifacts,
                       presign=settings.output_urls == "presigned")


@router.post("", status_code=status.HTTP_202_ACCEPTED, summary="Submit a job")
def create_job(body: JobRequest, ctx: Ctx, response: Response) -> dict[str, Any]:
    job = ctx.submitter.submit(body.pipeline, body.input, body.params)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return _present(ctx, job)


@router.get("", summary="List jobs, newest first")
def list_jobs(
    ctx: Ctx,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    cursor: Annotated[str | None, Query(max_length=32)] = None,
    status_: Annotated[JobStatus | None, Query(alias="status")] = None,
) -> JobList:
    limit = min(limit, ctx.runtime.settings.max_page_size)
    page = ctx.runtime.jobs.page(limit=limit, cursor=cursor, status=status_)
    return JobList(data=[_present(ctx, j) for j in page.jobs], next_cursor=page.next_cursor)


@router.get("/{job_id}", summary="Get a job")
def get_job(job_id: str, ctx: Ctx) -> dict[str, Any]:
    return _present(ctx, ctx.runtime.jobs.require(job_id))


@router.post("/{job_id}/cancel", summary="Cancel a queued or running job")
def cancel(job_id: str, ctx: Ctx) -> dict[str, Any]:
    return _present(ctx, cancel_job(ctx.runtime.jobs, job_id))


@router.get("/{job_id}/outputs/{name}", summary="Download one output file", response_class=Response)
def download_output(job_id: str, name: str, ctx: Ctx) -> Response:
    job = ctx.runtime.jobs.require(job_id)
    out = job.output(name)
    if out is None:
        raise JobNotFound(f"{job_id}/outputs/{name}")
    try:
        data = ctx.runtime.artifacts.get(out.artifact)
    except ArtifactNotFound:
        raise JobNotFound(f"{job_id}/outputs/{name}") from None
    filename = out.artifact.key.rsplit("/", 1)[-1]
    return Response(
        content=data,
        media_type=out.media_type,
        headers={"Content-Disposition": f'inline; filename="{filename}"'},
    )
