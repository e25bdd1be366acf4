"""Request and response bodies of the HTTP API (the wire shapes, in one place)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omni_jobs.jobs.view import JobView
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.limits import Limits
from omni_jobs.pipelines.schema import input_schema, params_schema
from omni_jobs.pipelines.spec import PipelineSpec

WEBHOOK_URL = r"^[Hh][Tt][Tt][Pp][Ss]?://([^/?#@\s]*@)?[^/?#@:\[\]\s]+(:[0-9]*)?([/?#]\S*)?$"
"""What omni_jobs.report.webhooks.validate_webhook takes: an http(s) URL with a host (checked there, not by
pydantic). A bracketed IPv6 literal is not in the pattern (it is accepted where it parses)."""


class JobRequest(BaseModel):
    """POST /v1/jobs. ``input`` and ``params`` are checked against the pipeline: 422 names each wrong
    field. The spec says what each pipeline takes: one schema per pipeline (JobRequest.<name>), chosen
    by ``pipeline``, built by job_request_schemas from the checks themselves."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        # a filter without a webhook is refused (422 at webhook_events_filter)
        "if": {"required": ["webhook_events_filter"], "properties": {"webhook_events_filter": {"type": "array"}}},
        "then": {"required": ["webhook"], "properties": {"webhook": {"type": "string"}}},
    })

    pipeline: str = Field(min_length=1, max_length=100, examples=["text-to-image"])
    input: dict[str, Any] = Field(examples=[{"prompt": "a red fox in the snow"}])
    params: dict[str, dict[str, Any]] | None = Field(
        None, description="Per-stage overrides keyed by stage id, e.g. {'dit': {'seed': 7, 'height': 64}}."
    )
    webhook: str | None = Field(
        None, max_length=2048, description="http(s) URL that receives the job (signed, Standard Webhooks) as it changes. "
        "Refused (422) when the server has no signing secret, or when the host is private and not allowed "
        "(OMNI_WEBHOOK_ALLOW_PRIVATE).",
        examples=["https://example.com/hooks/omni"], json_schema_extra={"pattern": WEBHOOK_URL},
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


NO_WEBHOOKS = ("This server has no webhook signing secret (OMNI_WEBHOOK_SECRET), so it sends no webhooks: a "
               "job that asks for one is refused (422).")


def webhook_properties(base: dict[str, Any], *, webhooks: bool) -> dict[str, Any]:
    """``webhook`` and ``webhook_events_filter`` as this server takes them: as the model says, or, with
    no signing secret (a setting, fixed for the life of the process), null only."""
    if webhooks:
        return {name: base[name] for name in ("webhook", "webhook_events_filter")}
    return {name: {"type": "null", "title": base[name].get("title", name), "description": NO_WEBHOOKS}
            for name in ("webhook", "webhook_events_filter")}


def job_request_branch(base: dict[str, Any], spec: PipelineSpec, limits: Limits, *, webhooks: bool) -> dict[str, Any]:
    """The JobRequest of one pipeline: ``base`` (the model's schema) with that pipeline's name, its
    ``input`` and each stage's ``params``, built from the rules the submitter checks them with. A
    stage default above this server's cap makes ``params`` required (it must lower it)."""
    fields = base["properties"]
    params = {**params_schema(spec, limits), "description": fields["params"].get("description", "")}
    must_lower = bool(params.get("required"))
    properties = {
        **fields,
        "pipeline": {"type": "string", "const": spec.name, "title": "Pipeline"},
        "input": input_schema(spec, limits),
        "params": params if must_lower else {"anyOf": [params, {"type": "null"}], "default": None},
        **webhook_properties(fields, webhooks=webhooks),
    }
    branch = {key: value for key, value in base.items() if key not in ("if", "then") or webhooks}
    branch.update(title=f"JobRequest.{spec.name}", properties=properties,
                  description=f"POST /v1/jobs with pipeline '{spec.name}': {spec.description.strip()}",
                  required=sorted({*base.get("required", []), *(["params"] if must_lower else [])}))
    return branch


def job_request_schemas(base: dict[str, Any], catalogue: PipelineCatalogue, limits: Limits, *,
                        webhooks: bool) -> dict[str, dict[str, Any]]:
    """OpenAPI components for POST /v1/jobs: JobRequest, a oneOf on ``pipeline``, and its branches
    ``JobRequest.<pipeline>``, one per pipeline of the catalogue (built-in and OMNI_PIPELINES_PATH's,
    loaded once per process, so the spec holds for its life)."""
    components = {f"JobRequest.{spec.name}": job_request_branch(base, spec, limits, webhooks=webhooks)
                  for spec in catalogue}
    refs = {name.removeprefix("JobRequest."): f"#/components/schemas/{name}" for name in components}
    components["JobRequest"] = {
        "title": "JobRequest", "description": base.get("description", ""),
        "oneOf": [{"$ref": ref} for ref in refs.values()],
        "discriminator": {"propertyName": "pipeline", "mapping": refs},
    }
    return components


class JobList(BaseModel):
    data: list[JobView]
    next_cursor: str | None = Field(None, description="Pass as ?cursor= to get the next page.")


class PipelineInfo(BaseModel):
    name: str
    description: str
    inputs: dict[str, Any]
    stages: list[dict[str, Any]]
    outputs: list[dict[str, Any]]


class ErrorBody(BaseModel):
    """Every error but a field error: ``{"detail": "what went wrong"}``."""

    detail: str


class QuotaErrorBody(ErrorBody):
    """429: a tenant quota was reached; retry after the Retry-After header."""

    limit: str = Field(description="Which limit: max_active (jobs queued or running at once) or jobs_per_minute.")
    value: int = Field(description="The limit's value for this tenant.")


class FieldErrorItem(BaseModel):
    loc: list[str | int] = Field(description="Where: ['body', 'input', 'prompt'], ['query', 'limit'], "
                                 "['header', 'Cancel-After'], ...")
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    """422: the fields that are wrong (FastAPI's HTTPValidationError shape; items may carry more keys)."""

    detail: list[FieldErrorItem]


_ERRORS: dict[int, tuple[type[BaseModel], str]] = {
    400: (ErrorBody, "The body could not be parsed (not JSON, not UTF-8, or a broken multipart form)."),
    401: (ErrorBody, "No valid API key (Authorization: Bearer <key>)."),
    404: (ErrorBody, "No such resource, or it belongs to another tenant."),
    409: (ErrorBody, "Conflict: the job already finished, or the Idempotency-Key was used with another body."),
    413: (ErrorBody, "The body is larger than OMNI_MAX_REQUEST_BYTES."),
    422: (ValidationErrorBody, "A field is invalid; `detail` lists each one."),
    429: (QuotaErrorBody, "A tenant quota was reached: `limit` names it; retry after Retry-After."),
    503: (ErrorBody, "Overloaded (a queue is full) or a backing service is unavailable; retry after Retry-After."),
}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "string"}}}


def errors(*codes: int, **descriptions: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, each with its body model; ``descriptions``
    (``e404="..."``) replace the generic text."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        model, text = _ERRORS[code]
        out[code] = {"model": model, "description": descriptions.get(f"e{code}", text)}
        if code in (429, 503):
            out[code]["headers"] = RETRY_AFTER
    return out
