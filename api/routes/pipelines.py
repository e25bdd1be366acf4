"""/v1/pipelines: what can be run, with each pipeline's inputs and stage defaults."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, status

from api.auth import authenticate
from api.deps import ApiContext, get_context
from api.schemas import PipelineInfo, errors
from omni_jobs.core.errors import UnknownPipeline
from omni_jobs.pipelines.spec import PipelineSpec

router = APIRouter(prefix="/v1/pipelines", tags=["pipelines"], dependencies=[Depends(authenticate)],
                   responses=errors(401, 503))
Ctx = Annotated[ApiContext, Depends(get_context)]


def _info(spec: PipelineSpec) -> PipelineInfo:
    data = spec.model_dump(mode="json", by_alias=True)
    for stage in data["stages"]:
        stage_spec = spec.stage(stage["id"])
        stage["inputs"] = {port: str(b) for port, b in stage_spec.inputs.items()}
        stage["queue"] = stage_spec.queue_name
        stage["task"] = stage_spec.task_name
        stage["outputs"] = dict(stage_spec.outputs)  # port -> modality it hands over
    for out, spec_out in zip(data["outputs"], spec.outputs, strict=True):
        out["from"] = spec_out.from_text()
        out["type"] = spec.output_type(spec_out)
    return PipelineInfo(**data)


@router.get("", summary="List pipelines")
def list_pipelines(ctx: Ctx) -> list[PipelineInfo]:
    return [_info(spec) for spec in ctx.runtime.catalogue]


@router.get("/{name}", summary="Get one pipeline",
            responses=errors(404, e404="No pipeline of that name; the message lists the known ones."))
def get_pipeline(name: str, ctx: Ctx) -> PipelineInfo:
    try:
        spec = ctx.runtime.catalogue.get(name)
    except UnknownPipeline as exc:  # a missing resource in the path: 404 (in a job's body it is a 422)
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
    return _info(spec)
