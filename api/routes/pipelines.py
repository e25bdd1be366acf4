"""/v1/pipelines: what can be run, with each pipeline's inputs and stage defaults."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from api.deps import ApiContext, get_context
from api.schemas import PipelineInfo
from omni_jobs.pipelines.spec import PipelineSpec

router = APIRouter(prefix="/v1/pipelines", tags=["pipelines"])
Ctx = Annotated[ApiContext, Depends(get_context)]


def _info(spec: PipelineSpec) -> PipelineInfo:
    data = spec.model_dump(mode="json", by_alias=True)
    for stage in data["stages"]:
        stage["inputs"] = {port: str(b) for port, b in spec.stage(stage["id"]).inputs.items()}
        stage["queue"] = spec.stage(stage["id"]).queue_name
    for out, spec_out in zip(data["outputs"], spec.outputs, strict=True):
        out["from"] = str(spec_out.source)
    return PipelineInfo(**data)


@router.get("", summary="List pipelines")
def list_pipelines(ctx: Ctx) -> list[PipelineInfo]:
    return [_info(spec) for spec in ctx.runtime.catalogue]


@router.get("/{name}", summary="Get one pipeline")
def get_pipeline(name: str, ctx: Ctx) -> PipelineInfo:
    return _info(ctx.runtime.catalogue.get(name))
