"""Usage per tenant from a job's committed events (omni_jobs.report.usage.increments): what GET /v1/usage and the
Prometheus tenant counters both count."""

from __future__ import annotations

from omni_jobs.accept.submission import build_job
from omni_jobs.artifacts import ArtifactRef
from omni_jobs.jobs.models import EventType, JobEvent, JobOutput, JobStatus
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.report.metrics import TENANT_IMAGES, TENANT_TOKENS, record_usage
from omni_jobs.report.usage import day_of, increments

DAY = 1796601600.0  # 2026-12-07T00:00:00Z


def _ref(media_type: str) -> ArtifactRef:
    return ArtifactRef.for_bytes("local", "k", b"x", media_type)


def test_a_succeeded_text_to_image_job_counts_its_stages_tokens_and_images() -> None:
    job = build_job(load_catalogue().get("text-to-image"), {"prompt": "x"}, {})
    job.tenant, job.status = "acme", JobStatus.succeeded
    ar, dit = job.stage_record("ar"), job.stage_record("dit")
    ar.started_at, ar.finished_at, ar.metrics = DAY + 10, DAY + 10.5, {"prompt_tokens": 7.0, "completion_tokens": 3.0}
    dit.started_at, dit.finished_at = DAY + 11, DAY + 13.25
    job.outputs = [JobOutput(name="image", type="image", media_type="image/png", size=1, artifact=_ref("image/png")),
                   JobOutput(name="text", type="text", media_type="application/json", size=1,
                             artifact=_ref("application/json"))]
    events = [JobEvent(job_id=job.id, type=EventType.stage_succeeded, at=DAY + 10.5, data={"stage": "ar"}),
              JobEvent(job_id=job.id, type=EventType.stage_succeeded, at=DAY + 13.25, data={"stage": "dit"}),
              JobEvent(job_id=job.id, type=EventType.job_succeeded, at=DAY + 13.3)]
    found = {(i.tenant, i.day, i.field): i.amount for i in increments(job, events)}
    assert found == {("acme", "2026-12-07", f"stage_seconds:{ar.queue}"): 0.5,
                     ("acme", "2026-12-07", f"stage_seconds:{dit.queue}"): 2.25,
                     ("acme", "2026-12-07", "tokens_in"): 7.0, ("acme", "2026-12-07", "tokens_out"): 3.0,
                     ("acme", "2026-12-07", "jobs:succeeded"): 1, ("acme", "2026-12-07", "images"): 1}
    before = (TENANT_IMAGES.labels("acme")._value.get(), TENANT_TOKENS.labels("acme", "input")._value.get())
    record_usage(job, events)  # the Prometheus counters count the same
    assert TENANT_IMAGES.labels("acme")._value.get() == before[0] + 1
    assert TENANT_TOKENS.labels("acme", "input")._value.get() == before[1] + 7


def test_a_failed_job_counts_its_failing_stage_until_the_failure_and_audio_and_video_count_their_length() -> None:
    job = build_job(load_catalogue().get("text-to-text"), {"prompt": "x"}, {})
    job.tenant = "t"
    job.stage_record("ar").started_at = DAY - 1.0  # started the day before: counted on the day it ended
    failed = JobEvent(job_id=job.id, type=EventType.job_failed, at=DAY + 2.0,
                      data={"error": {"stage": "ar", "type": "X", "message": "boom"}})
    found = {(i.day, i.field): i.amount for i in increments(job, [failed])}
    assert found == {("2026-12-07", "jobs:failed"): 1, ("2026-12-07", "stage_seconds:ar"): 3.0}
    job.outputs = [JobOutput(name="a", type="audio", media_type="audio/wav", size=1, artifact=_ref("audio/wav"),
                             duration_s=2.5),
                   JobOutput(name="v", type="video", media_type="video/mp4", size=1, artifact=_ref("video/mp4"),
                             frames=24)]
    done = JobEvent(job_id=job.id, type=EventType.job_succeeded, at=DAY)
    found = {i.field: i.amount for i in increments(job, [done])}
    assert found == {"jobs:succeeded": 1, "audio_seconds": 2.5, "video_frames": 24}
    assert [i.field for i in increments(job, [JobEvent(job_id=job.id, type=EventType.job_queued, at=DAY)])] == \
        ["jobs:queued"]


def test_a_day_is_a_utc_day() -> None:
    assert day_of(DAY) == "2026-12-07" and day_of(DAY - 0.5) == "2026-12-06"
