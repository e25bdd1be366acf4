"""Accepting a job: validate the request against its pipeline, store the job, enqueue its first stages.

Validation happens here, before any work is queued, and reports every bad field at once with its
location (``input.prompt``, ``params.dit.height``) so the API can answer one clear 422.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError

from omni_jobs import keys
from omni_jobs.artifacts import ArtifactStore
from omni_jobs.auth import DEFAULT_TENANT
from omni_jobs.dispatch import Dispatcher, NextStep
from omni_jobs.errors import FieldError, IdempotencyConflict, InvalidRequest, Overloaded
from omni_jobs.input_files import InputFiles, PreparedImage, parse_image_value
from omni_jobs.jobs import state
from omni_jobs.jobs.models import Job, JobEvent, JobWebhook, StageRecord, new_job_id, now
from omni_jobs.jobs.store import JobStore
from omni_jobs.limits import Limits
from omni_jobs.net_guard import NetGuard, UnsafeWebhookUrl
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.spec import InputField, PipelineSpec
from omni_jobs.queue_depth import queue_depth
from omni_jobs.webhooks import validate_webhook

_PY_TYPES: dict[str, tuple[type, ...]] = {
    "text": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def _check_input_value(name: str, field: InputField, value: Any) -> list[FieldError]:
    loc: tuple[str | int, ...] = ("input", name)
    if field.type == "image":  # its form and size here; whether it decodes when the job is prepared
        try:
            parse_image_value(value, field)
        except ValueError as exc:
            return [FieldError(loc, str(exc), "invalid_image")]
        return []
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
            resolved[stage.id] = stage.params({**stage.defaults, **overrides}).model_dump()
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


@dataclass(frozen=True)
class Admission:
    """Refuses new jobs while the queue of their first stage is full (overload protection)."""

    broker: redis.Redis
    max_queued: int
    retry_after_s: int

    def check(self, spec: PipelineSpec) -> None:
        for queue in sorted({s.queue_name for s in spec.entry_stages()}):
            depth = queue_depth(self.broker, queue)
            if depth >= self.max_queued:
                raise Overloaded(queue, depth, self.max_queued, self.retry_after_s)


def request_fingerprint(pipeline: str, input_: Any, params: Any, webhook: Any = None,
                        webhook_events_filter: Any = None) -> str:
    """What makes two submissions "the same request" for Idempotency-Key purposes (the whole body)."""
    body = json.dumps({"pipeline": pipeline, "input": input_, "params": params or {}, "webhook": webhook,
                       "webhook_events_filter": webhook_events_filter}, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()


class JobSubmitter:
    """Validates, stores and enqueues new jobs (used by the API and the in-process runner)."""

    def __init__(self, store: JobStore, catalogue: PipelineCatalogue, dispatcher: Dispatcher, *,
                 admission: Admission | None = None, idempotency_ttl_s: int = 24 * 3600,
                 max_cancel_after_s: float = 7 * 24 * 3600, webhooks_enabled: bool = True,
                 artifacts: ArtifactStore | None = None, net_guard: NetGuard | None = None,
                 limits: Limits | None = None) -> None:
        self.store = store
        self.limits = limits
        self.net_guard = net_guard
        self.input_files = (InputFiles(artifacts, store, max_bytes=limits.max_image_bytes if limits else None,
                                       max_pixels=limits.max_image_pixels if limits else None)
                            if artifacts is not None else None)
        self.catalogue = catalogue
        self.dispatcher = dispatcher
        self.admission = admission
        self.idempotency_ttl_s = idempotency_ttl_s
        self.max_cancel_after_s = max_cancel_after_s
        self.webhooks_enabled = webhooks_enabled

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
        if self.limits is not None:
            errors.extend(self.limits.check_input(spec, clean_input))
            errors.extend(self.limits.check_params(clean_params))
        if errors:
            raise InvalidRequest(errors)
        return spec, clean_input, clean_params

    def validate_webhook(self, url: Any, events: Any) -> JobWebhook | None:
        """The job's webhook settings; refused when this server has no secret to sign with."""
        hook = validate_webhook(url, events)
        if hook is not None and not self.webhooks_enabled:
            raise InvalidRequest([FieldError(("webhook",), "this server has no webhook signing secret "
                                             "(OMNI_WEBHOOK_SECRET), so it sends no webhooks", "webhooks_disabled")])
        if hook is not None and self.net_guard is not None:
            try:
                self.net_guard.check(hook.url)
            except UnsafeWebhookUrl as exc:
                raise InvalidRequest([FieldError(("webhook",), str(exc), "unsafe_url")]) from None
        return hook

    def submit(self, pipeline: str, input_: Any, params: Any = None, *, cancel_after_s: float | None = None,
               idempotency_key: str | None = None, webhook: Any = None, webhook_events_filter: Any = None,
               tenant: str = DEFAULT_TENANT) -> Job:
        return self.submit_idempotent(pipeline, input_, params, cancel_after_s=cancel_after_s,
                                      idempotency_key=idempotency_key, webhook=webhook,
                                      webhook_events_filter=webhook_events_filter, tenant=tenant)[0]

    def submit_idempotent(self, pipeline: str, input_: Any, params: Any = None, *,
                          cancel_after_s: float | None = None,
                          idempotency_key: str | None = None, webhook: Any = None,
                          webhook_events_filter: Any = None, tenant: str = DEFAULT_TENANT) -> tuple[Job, bool]:
        """(job, created): with a key seen before and the same body, the earlier job and False.

        ``tenant`` owns the job; Idempotency-Keys and referenced outputs are looked up within it.
        """
        hook_errors: list[FieldError] = []
        hook: JobWebhook | None = None
        try:
            hook = self.validate_webhook(webhook, webhook_events_filter)
        except InvalidRequest as exc:
            hook_errors = exc.errors
        try:
            spec, clean_input, clean_params = self.validate(pipeline, input_, params)
        except InvalidRequest as exc:
            raise InvalidRequest([*exc.errors, *hook_errors]) from None
        if hook_errors:
            raise InvalidRequest(hook_errors)
        files = self._prepare_files(spec, clean_input, tenant)
        if cancel_after_s is not None and not 0 < cancel_after_s <= self.max_cancel_after_s:
            raise InvalidRequest([FieldError(("header", "Cancel-After"),
                                             f"must be between 0 and {self.max_cancel_after_s:g} seconds")])
        job = build_job(spec, clean_input, clean_params)
        job.webhook = hook
        job.tenant = tenant
        if idempotency_key is not None:
            earlier = self._claim_idempotency_key(idempotency_key, job.id, request_fingerprint(
                pipeline, input_, params, webhook, webhook_events_filter), tenant=tenant)
            if earlier is not None:
                return earlier, False
        if self.admission is not None:
            self.admission.check(spec)
        if files and self.input_files is not None:
            job.input = {**job.input, **self.input_files.store(job.id, files)}
        at = now()
        if cancel_after_s is not None:
            job.deadline_at = job.created_at + cancel_after_s
        events: list[JobEvent] = [JobEvent(job_id=job.id, type="job.queued", at=at, data={"pipeline": spec.name})]
        entry = spec.entry_stages()
        for stage in entry:
            events += state.stage_queued(job, stage.id, at)
        self.store.create(job, events)
        for stage in entry:
            if self.store.claim_enqueue(job.id, stage.id):
                self.dispatcher.dispatch(NextStep(job.id, stage.id, stage.queue_name))
        return job, True

    def _prepare_files(self, spec: PipelineSpec, input_: dict[str, Any], tenant: str) -> dict[str, PreparedImage]:
        """Image inputs resolved and normalized before anything is claimed or stored."""
        if not spec.file_inputs() or not any(name in input_ for name in spec.file_inputs()):
            return {}
        if self.input_files is None:
            raise InvalidRequest([FieldError(("input", name), "this server has no artifact store for file inputs")
                                  for name in spec.file_inputs() if name in input_])
        return self.input_files.prepare(spec, input_, tenant=tenant)

    def _claim_idempotency_key(self, key: str, job_id: str, fingerprint: str, *,
                               tenant: str = DEFAULT_TENANT) -> Job | None:
        """None when the key is new (now bound to job_id); else the job it was used for (keys are per tenant)."""
        redis_key = keys.idempotency(key if tenant == DEFAULT_TENANT else f"{tenant}:{key}")
        record = json.dumps({"job_id": job_id, "fingerprint": fingerprint})
        for _ in range(50):
            if self.store.redis.set(redis_key, record, nx=True, ex=self.idempotency_ttl_s):
                return None
            raw = self.store.redis.get(redis_key)
            if raw is None:  # expired between the two calls
                continue
            earlier = json.loads(raw)
            if earlier["fingerprint"] != fingerprint:
                raise IdempotencyConflict(key, earlier["job_id"])
            # The first request may still be writing its job: wait for it briefly.
            job = self.store.get(earlier["job_id"])
            if job is not None:
                return job
            time.sleep(0.02)
        raise IdempotencyConflict(key, "(unknown)")
