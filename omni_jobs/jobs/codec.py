"""A Job as flat hash fields, and back: what the job hash in Redis (or in memory) holds.

One field per scalar attribute, JSON for the few structured ones (input, params, outputs, ...),
and one field per stage attribute (``stage:<id>:status``). So a transition writes only the fields
it changed (``diff``), a guard compares one field, and a reader gets the whole job with one
HGETALL. Progress and webhook deliveries live in keys of their own (written often, or appended).
"""

from __future__ import annotations

from collections.abc import Mapping

from omni_jobs.core import jsontext
from omni_jobs.jobs.models import (
    Job,
    JobError,
    JobOutput,
    JobStatus,
    JobWebhook,
    Priority,
    Progress,
    StageRecord,
    StageStatus,
    StepSlot,
    WebhookDelivery,
)

Fields = dict[str, str]
RawFields = Mapping[bytes, bytes] | Mapping[str, str]

_JOB_FLOATS = ("created_at", "started_at", "completed_at", "deadline_at")
_STAGE_FLOATS = ("queued_at", "started_at", "finished_at", "lease_until")
_STAGE_STRINGS = ("worker", "lease_owner")
_RESULTS_FLOATS = ("queued_at", "lease_until")


def stage_field(stage_id: str, name: str) -> str:
    return f"stage:{stage_id}:{name}"


def results_field(name: str) -> str:
    return f"results:{name}"


def _json(value: object) -> str:
    return jsontext.dumps(value, sort_keys=True)


def _put(fields: Fields, name: str, value: float | str | None) -> None:
    if value is not None:
        fields[name] = repr(value) if isinstance(value, float) else str(value)


def _stage_info(record: StageRecord) -> dict[str, object]:
    info: dict[str, object] = {"id": record.id, "engine": record.engine, "queue": record.queue, "needs": record.needs}
    if record.streams:
        info["streams"] = record.streams
    return info


def encode(job: Job) -> Fields:
    """Every stored field of ``job`` (progress and webhook deliveries excluded: they have their own keys)."""
    fields: Fields = {"id": job.id, "pipeline": job.pipeline, "status": job.status.value, "tenant": job.tenant,
                      "priority": job.priority.value,
                      "input": _json(job.input), "params": _json(job.params),
                      "stages": _json([_stage_info(r) for r in job.stages])}
    for name in _JOB_FLOATS:
        _put(fields, name, getattr(job, name))
    _put(fields, "stage", job.stage)
    if job.error is not None:
        fields["error"] = _json(job.error.model_dump(mode="json"))
    if job.outputs:
        fields["outputs"] = _json([o.model_dump(mode="json") for o in job.outputs])
    if job.webhook is not None:
        fields["webhook"] = _json({"url": job.webhook.url, "events": job.webhook.events})
    for record in job.stages:
        if record.outputs:
            fields[stage_field(record.id, "outputs")] = _json({k: v.model_dump(mode="json")
                                                               for k, v in record.outputs.items()})
        if record.metrics:
            fields[stage_field(record.id, "metrics")] = _json(record.metrics)
    fields.update(_slot_fields(job))
    return fields


def _slot_fields(job: Job) -> Fields:
    """The job's status and each stage's and the results step's status, attempts, times and lease."""
    fields: Fields = {"status": job.status.value}
    for record in job.stages:
        sid = record.id
        fields[stage_field(sid, "status")] = record.status.value
        fields[stage_field(sid, "attempts")] = str(record.attempts)
        for name in _STAGE_FLOATS:
            _put(fields, stage_field(sid, name), getattr(record, name))
        for name in _STAGE_STRINGS:
            _put(fields, stage_field(sid, name), getattr(record, name))
    slot = job.results
    fields[results_field("status")] = slot.status.value
    fields[results_field("attempts")] = str(slot.attempts)
    for name in _RESULTS_FLOATS:
        _put(fields, results_field(name), getattr(slot, name))
    for name in _STAGE_STRINGS:
        _put(fields, results_field(name), getattr(slot, name))
    return fields


def diff(before: Fields, after: Fields) -> tuple[Fields, list[str]]:
    """(fields to set, fields to delete) that turn ``before`` into ``after``."""
    sets = {k: v for k, v in after.items() if before.get(k) != v}
    return sets, sorted(set(before) - set(after))


def _text(fields: RawFields) -> dict[str, str]:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in fields.items()}


def _float(value: str | None) -> float | None:
    return float(value) if value is not None else None


def decode(raw: RawFields, progress: bytes | str | None = None,
           deliveries: list[bytes] | list[str] | None = None) -> Job | None:
    """The Job in ``raw`` (None for an empty hash: the job does not exist, or expired)."""
    f = _text(raw)
    if "id" not in f:
        return None
    stages: list[StageRecord] = []
    for info in jsontext.loads(f["stages"]):
        sid = info["id"]
        outputs = jsontext.loads(f.get(stage_field(sid, "outputs"), "{}"))
        stages.append(StageRecord(
            id=sid, engine=info["engine"], queue=info["queue"], needs=info.get("needs", []),
            streams=info.get("streams", []),
            status=StageStatus(f[stage_field(sid, "status")]),
            attempts=int(f.get(stage_field(sid, "attempts"), "0")),
            outputs=outputs, metrics=jsontext.loads(f.get(stage_field(sid, "metrics"), "{}")),
            **{n: _float(f.get(stage_field(sid, n))) for n in _STAGE_FLOATS},
            **{n: f.get(stage_field(sid, n)) for n in _STAGE_STRINGS},
        ))
    webhook = None
    if "webhook" in f:
        webhook = JobWebhook(**jsontext.loads(f["webhook"]), deliveries=[
            WebhookDelivery.model_validate_json(d) for d in (deliveries or [])])
    return Job(
        id=f["id"], pipeline=f["pipeline"], status=JobStatus(f["status"]), tenant=f["tenant"],
        priority=Priority(f.get("priority", Priority.normal.value)),
        input=jsontext.loads(f["input"]), params=jsontext.loads(f["params"]), stage=f.get("stage"),
        progress=Progress.model_validate_json(progress) if progress else None,
        stages=stages,
        outputs=[JobOutput(**o) for o in jsontext.loads(f.get("outputs", "[]"))],
        error=JobError(**jsontext.loads(f["error"])) if "error" in f else None,
        webhook=webhook,
        results=StepSlot(
            status=StageStatus(f.get(results_field("status"), StageStatus.pending.value)),
            attempts=int(f.get(results_field("attempts"), "0")),
            queued_at=_float(f.get(results_field("queued_at"))),
            lease_until=_float(f.get(results_field("lease_until"))),
            worker=f.get(results_field("worker")), lease_owner=f.get(results_field("lease_owner")),
        ),
        **{n: _float(f.get(n)) for n in _JOB_FLOATS},
    )
