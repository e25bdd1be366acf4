"""Accepting a job: validate the request against its pipeline, then store it and its first dispatches.

Validation happens here, before anything is written, and reports every bad field at once with its
location (``input.prompt``, ``params.dit.height``) so the API can answer one clear 422. Then ONE
atomic write (omni_jobs.jobs.ledger) stores the job, its Idempotency-Key record and the dispatch of
its first stages (outbox): all of them, or none. A relay publishes the dispatches afterwards.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from pydantic import ValidationError

from omni_jobs.accept.auth import DEFAULT_TENANT
from omni_jobs.artifacts import ArtifactStore
from omni_jobs.core.errors import FieldError, IdempotencyConflict, InvalidRequest, Overloaded, QuotaExceeded
from omni_jobs.core.json_types import JsonObject, JsonScalar, JsonValue
from omni_jobs.core.net_guard import NetGuard, UnsafeWebhookUrl
from omni_jobs.dispatch.scheduling import Quotas
from omni_jobs.jobs.change import Guard
from omni_jobs.jobs.flows import Blocking, Flow, Get, Idempotency, adrive, drive
from omni_jobs.jobs.ledger import JobLedger, QueueLimit, Quota, RequirementFailed, Submitted
from omni_jobs.jobs.models import Job, JobWebhook, Priority, StageRecord, new_job_id
from omni_jobs.jobs.store import JobStore
from omni_jobs.media.input_files import InputFiles, PreparedFile, parse_file_value
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.limits import Limits
from omni_jobs.pipelines.params import BOUND_ERRORS, bounds_in_words, whole_number
from omni_jobs.pipelines.schema import json_object, stage_params_schema
from omni_jobs.pipelines.spec import InputField, PipelineSpec, StageSpec
from omni_jobs.report.webhooks import validate_webhook

log = logging.getLogger(__name__)

REFUSED = (QuotaExceeded, Overloaded, IdempotencyConflict, RequirementFailed)
"""What a submit's write refuses with, having written nothing (a NotDurable write applied; a lost
connection may have): a job's input files stored for it are then nobody's, and go."""

StageParamValues = dict[str, dict[str, JsonScalar]]
"""A job's parameters: each stage's values, validated (what Job.params records)."""


_PY_TYPES: dict[str, tuple[type, ...]] = {
    "text": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def _check_input_value(name: str, field: InputField, value: object) -> list[FieldError]:
    loc: tuple[str | int, ...] = ("input", name)
    if field.is_file:  # its form and size here; whether it decodes when the job is prepared
        try:
            parse_file_value(value, field)
        except ValueError as exc:
            return [FieldError(loc, str(exc), f"invalid_{field.type}")]
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
        if field.choices is not None and value not in field.choices:
            return [FieldError(loc, f"is {value!r}; one of {', '.join(field.choices)}", "not_a_choice")]
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:  # JSON can escape half a UTF-16 pair (\ud83d); no engine reads it
                return [FieldError(loc, f"is not valid Unicode text: half a surrogate pair at character {exc.start} "
                                        "(send the whole character, or both halves of its \\u escape)", "invalid_text")]
    return []


def validate_input(spec: PipelineSpec, raw: object) -> JsonObject:
    if not isinstance(raw, dict):
        raise InvalidRequest([FieldError(("input",), "must be an object", "type_error")])
    errors: list[FieldError] = []
    clean: JsonObject = {}
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
        value = whole_number(raw[name]) if field.type == "integer" else raw[name]  # 7.0 is an integer
        problems = _check_input_value(name, field, value)
        errors.extend(problems)
        if not problems:  # checked: a str, int, float or bool, or a file's value (bytes until it is stored)
            clean[name] = cast(JsonValue, value)
    if errors:
        raise InvalidRequest(errors)
    return clean


def resolve_params(spec: PipelineSpec, raw: object, limits: Limits | None = None) -> StageParamValues:
    """Each stage's defaults overlaid by the job's overrides, validated; the result is recorded on the job.
    ``limits``: this server's caps, named in a bound's error as the schema publishes them (Limits.check_params
    refuses what is above them)."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise InvalidRequest([FieldError(("params",), "must be an object keyed by stage id", "type_error")])
    errors: list[FieldError] = []
    stage_ids = [s.id for s in spec.stages]
    for sid in sorted(set(raw) - set(stage_ids)):
        errors.append(FieldError(("params", sid), f"pipeline '{spec.name}' has no stage '{sid}'; stages: {stage_ids}", "extra"))
    resolved: StageParamValues = {}
    for stage in spec.stages:
        overrides = raw.get(stage.id) or {}
        if not isinstance(overrides, dict):
            errors.append(FieldError(("params", stage.id), "must be an object", "type_error"))
            continue
        try:  # flat: JSON scalars
            resolved[stage.id] = (stage.params({**stage.defaults, **overrides}).model_dump() if overrides
                                  else dict(stage.default_params))
        except ValidationError as exc:
            for err in exc.errors():
                loc = ("params", stage.id, *(str(p) for p in err["loc"]))
                msg = err["msg"].removeprefix("Value error, ")
                allowed = _allowed(stage, str(err["loc"][0]), limits) if err["type"] in BOUND_ERRORS else ""
                errors.append(FieldError(loc, f"{msg} (allowed: {allowed})" if allowed else msg, err["type"]))
    if errors:
        raise InvalidRequest(errors)
    return resolved


def _allowed(stage: StageSpec, name: str, limits: Limits | None) -> str:
    """Parameter ``name``'s bounds in words, as the published schema has them (this server's caps applied)."""
    prop = json_object(stage_params_schema(stage, limits)["properties"], "properties").get(name)
    branches = prop.get("anyOf", [prop]) if isinstance(prop, dict) else []  # a nullable number: its number branch
    numbers = [b for b in branches if isinstance(b, dict) and b.get("type") in ("integer", "number")] \
        if isinstance(branches, list) else []
    number: JsonObject = numbers[0] if numbers else {}

    def bound(key: str) -> float | None:
        value = number.get(key)
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    return ", ".join(bounds_in_words(*(bound(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                                          "multipleOf"))))


def build_job(spec: PipelineSpec, input_: JsonObject, params: StageParamValues) -> Job:
    return Job(
        id=new_job_id(),
        pipeline=spec.name,
        input=input_,
        params=params,
        stages=[StageRecord(id=s.id, engine=s.engine, queue=s.queue_name, needs=sorted(s.upstream()),
                            streams=[s.stream_source.source] if s.stream_source is not None else [])
                for s in spec.stages],
    )


@dataclass(frozen=True)
class Admission:
    """Refuses new jobs while the queue of their first stage is full (overload protection).

    It counts the steps waiting on the queue in the job store's own index, which includes what is
    accepted but not yet published: so it holds while the broker is away. The count is taken in the
    submit's own atomic write (a cap of the Change, QueueLimit), so a burst cannot slip past it and
    it costs no read of its own. ``store`` is the store those writes go to; ``check`` reads it
    beforehand, for a submit that would otherwise store its input files for nothing.
    """

    store: JobStore
    max_queued: int
    retry_after_s: int

    def limits(self, spec: PipelineSpec) -> list[QueueLimit]:
        return [QueueLimit(queue, self.max_queued, self.retry_after_s) for queue in _entries(spec)[1]]

    def check(self, spec: PipelineSpec) -> None:
        """Overloaded now, if an entry queue is full (the write checks again, atomically)."""
        for queue in _entries(spec)[1]:
            waiting, _running = self.store.queue_counts(queue)
            if waiting >= self.max_queued:
                raise Overloaded(queue, waiting, self.max_queued, self.retry_after_s)


_ENTRIES: dict[int, tuple[PipelineSpec, list[str], tuple[str, ...], frozenset[str]]] = {}


def _entries(spec: PipelineSpec) -> tuple[list[str], tuple[str, ...], frozenset[str]]:
    """The stages a pipeline's jobs start with, their queues, and its file inputs (asked on every
    submit; a loaded spec does not change, and it is kept here with its answer so that its id is not
    reused)."""
    found = _ENTRIES.get(id(spec))
    if found is None or found[0] is not spec:
        entry = spec.entry_stages()
        found = _ENTRIES[id(spec)] = (spec, [s.id for s in entry], tuple(sorted({s.queue_name for s in entry})),
                                      frozenset(spec.file_inputs()))
    return found[1], found[2], found[3]


def request_fingerprint(pipeline: str, input_: object, params: object, webhook: object = None,
                        webhook_events_filter: object = None, priority: str = "normal") -> str:
    """What makes two submissions "the same request" for Idempotency-Key purposes (the whole body)."""
    fields: dict[str, object] = {"pipeline": pipeline, "input": input_, "params": params or {}, "webhook": webhook,
              "webhook_events_filter": webhook_events_filter}
    if priority != "normal":  # so that the fingerprints of requests before priorities existed hold
        fields["priority"] = priority
    body = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()


@dataclass
class _NewJob:
    """A validated submission, before any I/O: its pipeline, the job to store, where it starts, and
    its Idempotency-Key claim (key, request fingerprint)."""

    spec: PipelineSpec
    job: Job
    entry_stages: list[str]
    claim: tuple[str, str] | None


class JobSubmitter:
    """Validates, stores and enqueues new jobs (used by the API and the in-process runner)."""

    def __init__(self, ledger: JobLedger, catalogue: PipelineCatalogue, *,
                 admission: Admission | None = None, idempotency_ttl_s: int = 24 * 3600,
                 max_cancel_after_s: float = 7 * 24 * 3600, webhooks_enabled: bool = True,
                 artifacts: ArtifactStore | None = None, net_guard: NetGuard | None = None,
                 limits: Limits | None = None, quotas: Quotas | None = None) -> None:
        self.ledger = ledger
        self.quotas = quotas
        self.limits = limits
        self.net_guard = net_guard
        self.input_files = InputFiles(artifacts, ledger.store, limits=limits) if artifacts is not None else None
        self.catalogue = catalogue
        self.admission = admission
        self.idempotency_ttl_s = idempotency_ttl_s
        self.max_cancel_after_s = max_cancel_after_s
        self.webhooks_enabled = webhooks_enabled

    def validate(self, pipeline: str, input_: object, params: object) -> tuple[PipelineSpec, JsonObject, StageParamValues]:
        spec = self.catalogue.get(pipeline)
        errors: list[FieldError] = []
        clean_input: JsonObject = {}
        clean_params: StageParamValues = {}
        try:
            clean_input = validate_input(spec, input_)
        except InvalidRequest as exc:
            errors.extend(exc.errors)
        try:
            clean_params = resolve_params(spec, params, self.limits)
        except InvalidRequest as exc:
            errors.extend(exc.errors)
        if self.limits is not None:
            errors.extend(self.limits.check_input(spec, clean_input))
            errors.extend(self.limits.check_params(clean_params))
        if errors:
            raise InvalidRequest(errors)
        return spec, clean_input, clean_params

    def validate_webhook(self, url: object, events: object) -> JobWebhook | None:
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

    def submit(self, pipeline: str, input_: object, params: object = None, *, cancel_after_s: float | None = None,
               idempotency_key: str | None = None, webhook: object = None, webhook_events_filter: object = None,
               tenant: str = DEFAULT_TENANT, priority: object = None, api_key_id: str | None = None) -> Job:
        return self.submit_idempotent(pipeline, input_, params, cancel_after_s=cancel_after_s,
                                      idempotency_key=idempotency_key, webhook=webhook,
                                      webhook_events_filter=webhook_events_filter, tenant=tenant, priority=priority,
                                      api_key_id=api_key_id)[0]

    def submit_idempotent(self, pipeline: str, input_: object, params: object = None, *,
                          cancel_after_s: float | None = None,
                          idempotency_key: str | None = None, webhook: object = None,
                          webhook_events_filter: object = None, tenant: str = DEFAULT_TENANT, priority: object = None,
                          api_key_id: str | None = None, requires: Sequence[Guard] = ()) -> tuple[Job, bool]:
        """(job, created): with a key seen before and the same body, the earlier job and False.

        ``tenant`` owns the job; Idempotency-Keys and referenced outputs are looked up within it, and
        its quotas (or those of ``api_key_id``, the key that submits) apply. ``submit_flow`` on this thread.
        """
        done = drive(self.ledger.store, self.submit_flow(
            pipeline, input_, params, cancel_after_s=cancel_after_s, idempotency_key=idempotency_key,
            webhook=webhook, webhook_events_filter=webhook_events_filter, tenant=tenant, priority=priority,
            api_key_id=api_key_id, requires=requires))
        return done.job, done.created

    def submit_all(self, pipeline: str, input_: object, params: Sequence[object], *,
                   idempotency_keys: Sequence[str | None] | None = None, tenant: str = DEFAULT_TENANT,
                   api_key_id: str | None = None, priority: object = None) -> list[Job]:
        """One job per entry of ``params`` (same input), all stored in one write or none: a quota, a full
        queue or a bad value refuses the whole call before any job exists (the OpenAI images route's
        ``n``). ``idempotency_keys``: one per job (a key used before answers its earlier job). Jobs with
        file inputs are not taken here (that route sends a text prompt). ``priority``: every job's (a batch's
        lines: low)."""
        keys = list(idempotency_keys) if idempotency_keys is not None else [None] * len(params)
        if len(keys) != len(params):
            raise ValueError(f"{len(params)} jobs and {len(keys)} Idempotency-Keys")
        new = [self._accept(pipeline, input_, job_params, cancel_after_s=None, idempotency_key=key, webhook=None,
                            webhook_events_filter=None, tenant=tenant, priority=priority)
               for job_params, key in zip(params, keys, strict=True)]
        if new and self._has_files(new[0].spec, new[0].job.input):
            raise InvalidRequest([FieldError(("input", name), "jobs submitted together take no file inputs")
                                  for name in new[0].spec.file_inputs() if name in new[0].job.input])
        quota = self._quota(tenant, api_key_id)
        self._fits(len(new), quota)
        made = self.ledger.submit_all([(n.job, n.entry_stages, n.claim) for n in new],
                                      idempotency_ttl_s=self.idempotency_ttl_s, quota=quota,
                                      queue_limits=self._queue_limits(new[0].spec) if new else [])
        return [job for job, _created in made]

    @staticmethod
    def _fits(count: int, quota: Quota | None) -> None:
        """A call of ``count`` jobs that the tenant's quota can never hold at once is a bad request (400 naming
        the count), not a 429 that a client would retry for ever."""
        for name, limit in (("max_active", quota.max_active if quota else 0),
                            ("jobs_per_minute", quota.per_minute if quota else 0)):
            if limit and count > limit:
                raise InvalidRequest([FieldError(("n",), f"is {count}, above this tenant's {name} quota of {limit}: "
                                                 f"ask for at most {limit} at once", "quota")])

    async def asubmit_idempotent(self, pipeline: str, input_: object, params: object = None, *,
                                 cancel_after_s: float | None = None, idempotency_key: str | None = None,
                                 webhook: object = None, webhook_events_filter: object = None, tenant: str = DEFAULT_TENANT,
                                 priority: object = None, api_key_id: str | None = None,
                                 requires: Sequence[Guard] = ()) -> Submitted:
        """``submit_idempotent`` for an event loop (the API): ``submit_flow`` through the store's async
        client. A job without file inputs costs one Redis round trip, with an Idempotency-Key too (the
        write's guard finds a replay), and no thread; file inputs are read and stored in a thread. The
        answer also carries the job's queue position, read in the same round trip."""
        return await adrive(self.ledger.store, self.submit_flow(
            pipeline, input_, params, cancel_after_s=cancel_after_s, idempotency_key=idempotency_key,
            webhook=webhook, webhook_events_filter=webhook_events_filter, tenant=tenant, priority=priority,
            api_key_id=api_key_id, requires=requires, placed=True))

    def submit_flow(self, pipeline: str, input_: object, params: object, *, cancel_after_s: float | None,
                    idempotency_key: str | None, webhook: object, webhook_events_filter: object, tenant: str,
                    priority: object, api_key_id: str | None, requires: Sequence[Guard],
                    placed: bool = False) -> Flow[Submitted]:
        """A submit, for either driver (omni_jobs.jobs.flows): validate, store any file inputs, then the
        ledger's one write (JobLedger.submit_flow; ``requires``: guards the write must find true).
        What blocks (a webhook host's DNS lookup, reading and storing files) is ``Blocking``: on the
        event loop it runs in a thread. ``placed``: the answer carries the job's queue position."""
        accept = functools.partial(self._accept, pipeline, input_, params, cancel_after_s=cancel_after_s,
                                   idempotency_key=idempotency_key, webhook=webhook,
                                   webhook_events_filter=webhook_events_filter, tenant=tenant, priority=priority)
        # A webhook URL's host is resolved (NetGuard) by the blocking OS resolver, which can take
        # seconds: off the event loop, so one slow DNS answer does not stall every other request.
        new = (yield from Blocking(accept)) if webhook is not None and self.net_guard is not None else accept()
        files = (yield from Blocking(functools.partial(self._prepare_files, new.spec, new.job.input, tenant))) \
            if self._has_files(new.spec, new.job.input) else {}
        if new.claim is not None and files:  # a replay stores no files; without files the write's guard finds it
            earlier = yield from Idempotency(tenant, new.claim[0])
            if earlier is not None:  # a replay: answer it before any check that could refuse it
                if earlier.fingerprint != new.claim[1]:
                    raise IdempotencyConflict(new.claim[0], earlier.job_id)
                existing = yield from Get(earlier.job_id)
                if existing is not None:
                    return (yield from self.ledger.replayed(existing, placed=placed))
        stored = bool(files) and self.input_files is not None
        if files and self.input_files is not None:
            if self.admission is not None:  # before storing files that a full queue would leave unused
                yield from Blocking(functools.partial(self.admission.check, new.spec))
            records = yield from Blocking(functools.partial(self.input_files.store, new.job.id, files))
            new.job.input = {**new.job.input, **records}
        try:
            submitted = yield from self.ledger.submit_flow(
                new.job, new.entry_stages, idempotency=new.claim, idempotency_ttl_s=self.idempotency_ttl_s,
                quota=self._quota(tenant, api_key_id), queue_limits=self._queue_limits(new.spec),
                requires=requires, placed=placed)
        except REFUSED:
            if stored:
                yield from Blocking(functools.partial(self._forget_files, new.job.id))
            raise
        if stored and submitted.job.id != new.job.id:  # a replay found by the write: another job's answer
            yield from Blocking(functools.partial(self._forget_files, new.job.id))
        return submitted

    def _accept(self, pipeline: str, input_: object, params: object, *, cancel_after_s: float | None,
                idempotency_key: str | None, webhook: object, webhook_events_filter: object, tenant: str,
                priority: object) -> _NewJob:
        """Everything a submit decides before any I/O: every bad field at once (InvalidRequest), else
        the job to store, its entry stages and its Idempotency-Key claim."""
        hook_errors: list[FieldError] = []
        hook: JobWebhook | None = None
        try:
            hook = self.validate_webhook(webhook, webhook_events_filter)
        except InvalidRequest as exc:
            hook_errors = exc.errors
        try:
            if priority is not None and not isinstance(priority, str):
                raise ValueError(priority)
            chosen_priority = Priority(priority if priority is not None else Priority.normal.value)
        except ValueError:
            hook_errors.append(FieldError(("priority",), f"must be one of {[p.value for p in Priority]}, got "
                                          f"{priority!r}", "enum"))
            chosen_priority = Priority.normal
        try:
            spec, clean_input, clean_params = self.validate(pipeline, input_, params)
        except InvalidRequest as exc:
            raise InvalidRequest([*exc.errors, *hook_errors]) from None
        if hook_errors:
            raise InvalidRequest(hook_errors)
        if cancel_after_s is not None and not 0 < cancel_after_s <= self.max_cancel_after_s:
            raise InvalidRequest([FieldError(("header", "Cancel-After"),
                                             f"must be between 0 and {self.max_cancel_after_s:g} seconds")])
        job = build_job(spec, clean_input, clean_params)
        job.webhook = hook
        job.tenant = tenant
        job.priority = chosen_priority
        if cancel_after_s is not None:
            job.deadline_at = job.created_at + cancel_after_s
        claim = None
        if idempotency_key is not None:
            claim = (idempotency_key, request_fingerprint(pipeline, input_, params, webhook, webhook_events_filter,
                                                          chosen_priority.value))
        return _NewJob(spec, job, list(_entries(spec)[0]), claim)

    def _forget_files(self, job_id: str) -> None:
        """Delete the input files stored for a job that the write did not make. Files go in only once the
        request is valid and decodes, before the write that checks quotas, the key and its
        Idempotency-Key, which cannot be checked earlier without a race; no job points at them, so
        retention (which walks jobs) would never delete them."""
        assert self.input_files is not None
        try:
            self.input_files.artifacts.delete_job(job_id)
        except Exception:  # the refusal is the answer; a file left over is only space
            log.warning("job %s was refused; its input files could not be deleted", job_id, exc_info=True)

    def _quota(self, tenant: str, api_key_id: str | None) -> Quota | None:
        """The submit's limits (cached by Quotas: a Redis read at most every few seconds per tenant or key)."""
        return self.quotas.for_submit(tenant, api_key_id) if self.quotas is not None else None

    def _queue_limits(self, spec: PipelineSpec) -> list[QueueLimit]:
        return self.admission.limits(spec) if self.admission is not None else []

    @staticmethod
    def _has_files(spec: PipelineSpec, input_: Mapping[str, object]) -> bool:
        files = _entries(spec)[2]
        return bool(files) and any(name in input_ for name in files)

    def _prepare_files(self, spec: PipelineSpec, input_: Mapping[str, object], tenant: str) -> dict[str, PreparedFile]:
        """File inputs resolved and normalized before anything is claimed or stored."""
        if not self._has_files(spec, input_):
            return {}
        if self.input_files is None:
            raise InvalidRequest([FieldError(("input", name), "this server has no artifact store for file inputs")
                                  for name in spec.file_inputs() if name in input_])
        return self.input_files.prepare(spec, input_, tenant=tenant)
