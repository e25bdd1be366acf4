"""Accepting a job: validate the request against its pipeline, store the job, enqueue its first stages.

Validation happens here, before any work is queued, and reports every bad field at once with its
location (``input.prompt``, ``params.dit.height``) so the API can answer one clear 422.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from omni_jobs.dispatch import Dispatcher, NextStep
from omni_jobs.errors import FieldError, InvalidRequest
from omni_jobs.jobs import state
from omni_jobs.jobs.models import Job, JobEvent, StageRecord, new_job_id, now
from omni_jobs.jobs.store import JobStore
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.params import merge_params
from omni_jobs.pipelines.spec import InputField, PipelineSpec

_PY_TYPES: dict[str, tuple[type, ...]] = {
    "text": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def _check_input_value(name: str, field: InputField, value: Any) -> list[FieldError]:
    loc: tuple[str | int, ...] = ("input", name)
    wanted = _PY_TYPES[field.type]
    is_bool = isinstance(value, bool)
    if not isinstance(value, wanted) or (is_bool and field.type != "boolean"):
        return [FieldError(loc, f"must be {field.type}, got {type(value).__name__}", "type_error")]
    if isinstance(value, str):
        if field.required and not value.strip():
            return [FieldError(loc, "must not be empty", "missing")]
        if field.max_length is not None and len(value) > field.max_length:
            return [FieldError(loc, f"is {len(value)} characters; at most {field.max_length}", "too_long")]
    return []


def validate_input(spec: PipelineSpec, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidRequest([FieldError(("input",), "must be an object", "type_error")])
    errors: list[FieldError] = []
    clean: dict[str, Any] = {}
    for name in sorted(set(raw) - set(spec.inputs)):
        errors.append(
            FieldError(("input", name), f"unknown field; pipeline '{spec.name}' takes {sorted(spec.inputs)}", "extra")
        )
    for name, field in spec.inputs.items():
        if name not in raw or raw[name] is None:
            if field.required and field.default is None:
                errors.append(FieldError(("input", name), f"is required ({field.type})", "missing"))
            elif field.default is not None:
                clean[name] = field.default
            continue
        problems = _check_input_value(name, field, raw[name])
        errors.extend(problems)
        if not problems:
            clean[name] = raw[name]
    if errors:
        raise InvalidRequest(errors)
    return clean


def resolve_params(spec: PipelineSpec, raw: Any) -> dict[str, dict[str, Any]]:
    """Each stage's defaults overlaid by the job's overrides, validated; the result is recorded on the job."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise InvalidRequest([FieldError(("params",), "must be an object keyed by stage id", "type_error")])
    errors: list[FieldError] = []
    stage_ids = [s.id for s in spec.stages]
    for sid in sorted(set(raw) - set(stage_ids)):
        errors.append(FieldError(("params", sid), f"pipeline '{spec.name}' has no stage '{sid}'; stages: {stage_ids}", "extra"))
    resolved: dict[str, dict[str, Any]] = {}
    for stage in spec.stages:
        overrides = raw.get(stage.id) or {}
        if not isinstance(overrides, dict):
            errors.append(FieldError(("params", stage.id), "must be an object", "type_error"))
            continue
        try:
            resolved[stage.id] = merge_params(stage.engine, stage.defaults, overrides).model_dump()
        except ValidationError as exc:
            for err in exc.errors():
                loc = ("params", stage.id, *(str(p) for p in err["loc"]))
                errors.append(FieldError(loc, err["msg"].removeprefix("Value error, "), err["type"]))
    if errors:
        raise InvalidRequest(errors)
    return resolved


def build_job(spec: PipelineSpec, input_: dict[str, Any], params: dict[str, dict[str, Any]]) -> Job:
    return Job(
        id=new_job_id(),
        pipeline=spec.name,
        input=input_,
        params=params,
        stages=[StageRecord(id=s.id, engine=s.engine, queue=s.queue_name) for s in spec.stages],
    )


class JobSubmitter:
    """Validates, stores and enqueues new jobs (used by the API and the in-process runner)."""

    def __init__(self, store: JobStore, catalogue: PipelineCatalogue, dispatcher: Dispatcher) -> None:
        self.store = store
        self.catalogue = catalogue
        self.dispatcher = dispatcher

    def validate(self, pipeline: str, input_: Any, params: Any) -> tuple[PipelineSpec, dict[str, Any], dict[str, dict[str, Any]]]:
        spec = self.catalogue.get(pipeline)
        errors: list[FieldError] = []
        clean_input: dict[str, Any] = {}
        clean_params: dict[str, dict[str, Any]] = {}
        try:
            clean_input = validate_input(spec, input_)
        except InvalidRequest as exc:
            errors.extend(exc.errors)
        try:
            clean_params = resolve_params(spec, params)
        except InvalidRequest as exc:
            errors.extend(exc.errors)
        if errors:
            raise InvalidRequest(errors)
        return spec, clean_input, clean_params

    def submit(self, pipeline: str, input_: Any, params: Any = None) -> Job:
        spec, clean_input, clean_params = self.validate(pipeline, input_, params)
        job = build_job(spec, clean_input, clean_params)
        at = now()
        events: list[JobEvent] = [JobEvent(job_id=job.id, type="job.queued", at=at, data={"pipeline": spec.name})]
        entry = spec.entry_stages()
        for stage in entry:
            events += state.stage_queued(job, stage.id, at)
        self.store.create(job, events)
        for stage in entry:
            if self.store.claim_enqueue(job.id, stage.id):
                self.dispatcher.dispatch(NextStep(job.id, stage.id, stage.queue_name))
        return job
