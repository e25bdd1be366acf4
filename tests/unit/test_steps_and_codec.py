"""The wire forms of job state v2: steps as tasks and as outbox JSON, a job as hash fields."""

from __future__ import annotations

import pytest

from omni_jobs.artifacts.refs import ArtifactRef
from omni_jobs.jobs import codec
from omni_jobs.jobs.models import (
    Job,
    JobError,
    JobOutput,
    JobStatus,
    JobWebhook,
    Progress,
    StageRecord,
    StageStatus,
    WebhookDelivery,
)
from omni_jobs.jobs.steps import (
    TASK_OF,
    AssembleResults,
    DeliverWebhook,
    RunStage,
    StepKind,
    display_name,
    from_json,
    from_task,
    parse_slot,
    step_id,
    task_args,
    to_json,
)

STEPS = [RunStage("job_ab", "dit", 2, "dit-gpu"), AssembleResults("job_ab", 1), DeliverWebhook("job_ab", "msg_1", "completed", 3)]


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.kind.value)
def test_a_step_survives_the_outbox_and_the_broker(step) -> None:  # type: ignore[no-untyped-def]
    assert from_json(to_json(step)) == step
    assert from_task(TASK_OF[step.kind], task_args(step), step.queue) == step
    slot = parse_slot(step.slot)
    assert slot.job_id == "job_ab" and slot.kind is step.kind
    assert step_id(step) == f"{step.slot}:{step.attempt}"


def test_display_names_carry_the_job_the_stage_and_the_attempt() -> None:
    assert display_name("omni.run_stage", task_args(STEPS[0])) == "omni.run_stage[job_ab/dit#2]"
    assert display_name("omni.assemble_results", task_args(STEPS[1])) == "omni.assemble_results[job_ab#1]"
    assert display_name("omni.deliver_webhook", task_args(STEPS[2])) == "omni.deliver_webhook[job_ab/webhook:completed#3]"
    assert parse_slot("results:job_ab").name is None and parse_slot("stage:job_ab:ar").kind is StepKind.run_stage
    for bad in ("stage:job_ab", "results:job_ab:x", "nope:job_ab:x", "stage:notajob:ar"):
        with pytest.raises(ValueError, match="not a step slot"):
            parse_slot(bad)


def full_job() -> Job:
    ref = ArtifactRef(backend="s3", key="jobs/j/stages/ar/attempt-1/text.json", media_type="application/json", size=9,
                      sha256="1" * 64)
    job = Job(id="job_ab", pipeline="text-to-image", status=JobStatus.running, tenant="acme",
              input={"prompt": "a fox", "n": 1.5}, params={"dit": {"seed": 7}}, stage="dit", created_at=1.25,
              started_at=2.5, deadline_at=99.0, webhook=JobWebhook(url="https://h/x", events=["completed"]),
              progress=Progress(stage="dit", step=3, total=8),
              stages=[StageRecord(id="ar", engine="ar", queue="ar", status=StageStatus.succeeded, attempts=2,
                                  queued_at=1.25, started_at=2.0, finished_at=2.4, worker="ar@h", outputs={"text": ref},
                                  metrics={"engine_s": 0.3}),
                      StageRecord(id="dit", engine="dit", queue="dit", status=StageStatus.running, attempts=1,
                                  worker="dit@h", lease_owner="dit@h#12.ab", lease_until=1e9 + 0.123456789,
                                  needs=["ar"])],
              outputs=[JobOutput(name="text", type="text", media_type="application/json", size=9, artifact=ref, text="hi")],
              error=JobError(stage="dit", type="X", message="y"))
    job.webhook.deliveries.append(WebhookDelivery(id="msg_1", event="completed", attempt=1, at=3.0, status_code=200))  # type: ignore[union-attr]
    return job


def test_a_job_survives_its_hash_fields_exactly() -> None:
    job = full_job()
    fields = codec.encode(job)
    assert fields["stage:dit:lease_until"] == repr(1e9 + 0.123456789) and "progress" not in fields
    assert all(isinstance(v, str) for v in fields.values())
    back = codec.decode({k.encode(): v.encode() for k, v in fields.items()}, job.progress.model_dump_json(),  # type: ignore[union-attr]
                        [d.model_dump_json() for d in job.webhook.deliveries])  # type: ignore[union-attr]
    assert back == job
    assert codec.decode({}) is None


def test_a_transition_writes_only_what_it_changed() -> None:
    before = full_job()
    after = before.model_copy(deep=True)
    after.stage_record("dit").lease_until = 2e9
    after.deadline_at = None
    sets, dels = codec.diff(codec.encode(before), codec.encode(after))
    assert sets == {"stage:dit:lease_until": repr(2e9)} and dels == ["deadline_at"]
