"""The job/stage state machine and request validation, with no services."""

from __future__ import annotations

import pytest

from omni_jobs.accept.submission import build_job, resolve_params, validate_input
from omni_jobs.core.errors import InvalidRequest, InvalidTransition
from omni_jobs.jobs import state
from omni_jobs.jobs.models import JobError, JobStatus, StageStatus
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.pipelines.limits import Limits

T2I = load_catalogue().get("text-to-image")


def new_job():
    return build_job(T2I, {"prompt": "a cat"}, resolve_params(T2I, {}))


def test_happy_path_timeline_and_events() -> None:
    job = new_job()
    assert job.status is JobStatus.queued and [s.status for s in job.stages] == [StageStatus.pending] * 2
    events = state.stage_queued(job, "ar", 10.0)
    events += state.stage_started(job, "ar", "ar@host", 11.0)
    assert job.status is JobStatus.running and job.started_at == 11.0 and job.stage == "ar"
    events += state.stage_progress(job, "ar", 3, 8, "tokens", 11.5)
    assert job.progress is not None and (job.progress.step, job.progress.total) == (3, 8)
    events += state.stage_succeeded(job, "ar", {}, {"engine_s": 0.5}, 12.0)
    assert job.stage is None and job.progress is None
    events += state.stage_queued(job, "dit", 12.0)
    events += state.stage_started(job, "dit", "dit@host", 12.5)
    events += state.stage_succeeded(job, "dit", {}, {}, 14.0)
    events += state.job_succeeded(job, 14.5)
    assert job.status is JobStatus.succeeded
    assert job.stage_record("ar").duration_s == 1.0 and job.stage_record("dit").duration_s == 1.5
    job.created_at = 10.0
    assert job.metrics() == {"queue_time_s": 1.0, "run_time_s": 3.5, "total_time_s": 4.5}
    assert [e.type for e in events] == [
        "stage.queued", "job.running", "stage.started", "stage.progress", "stage.succeeded",
        "stage.queued", "stage.started", "stage.succeeded", "job.succeeded",
    ]


def test_a_lost_attempt_is_requeued_and_the_next_one_counts() -> None:
    job = new_job()
    state.stage_queued(job, "ar", 1.0)
    state.stage_started(job, "ar", "w1", 2.0)
    with pytest.raises(InvalidTransition):  # a second start needs the first attempt to have ended
        state.stage_started(job, "ar", "w2", 2.5)
    events = state.stage_requeued(job, "ar", 3.0, reason="lease expired", retry_at=3.0, lost=True)
    assert [e.type for e in events] == ["stage.requeued"] and events[0].data["attempt"] == 1
    assert job.stage_record("ar").status is StageStatus.queued and job.stage_record("ar").queued_at == 3.0
    state.stage_started(job, "ar", "w2", 4.0)
    record = job.stage_record("ar")
    assert record.attempts == 2 and record.worker == "w2" and record.started_at == 4.0


def test_a_transient_error_backs_off_before_the_next_attempt() -> None:
    job = new_job()
    state.stage_queued(job, "ar", 1.0)
    state.stage_started(job, "ar", "w1", 2.0)
    (event,) = state.stage_requeued(job, "ar", 3.0, reason="S3 down", retry_at=5.0, lost=False)
    assert event.type == "stage.retrying" and event.data["retry_in_s"] == 2.0
    assert job.stage_record("ar").queued_at == 5.0  # runnable from then on: the wait is measured from there


def test_finished_job_cannot_run_again() -> None:
    job = new_job()
    state.stage_queued(job, "ar", 1.0)
    state.stage_started(job, "ar", "w", 2.0)
    state.job_failed(job, JobError(stage="ar", type="StageError", message="boom"), 3.0)
    assert job.status is JobStatus.failed
    assert job.stage_record("ar").status is StageStatus.failed
    assert job.stage_record("dit").status is StageStatus.canceled
    with pytest.raises(InvalidTransition):
        state.job_succeeded(job, 4.0)
    with pytest.raises(InvalidTransition):
        state.job_canceled(job, 4.0)


def test_cancel_queued_job_cancels_its_stages() -> None:
    job = new_job()
    state.stage_queued(job, "ar", 1.0)
    state.job_canceled(job, 2.0)
    assert job.status is JobStatus.canceled and job.completed_at == 2.0
    assert {s.status for s in job.stages} == {StageStatus.canceled}


def test_stage_cannot_skip_queue() -> None:
    job = new_job()
    with pytest.raises(InvalidTransition):
        state.stage_succeeded(job, "dit", {}, {}, 1.0)


def locs(exc: InvalidRequest) -> list[tuple]:
    return [e.loc for e in exc.errors]


def test_input_validation_names_each_field() -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_input(T2I, {"prompt": 5, "colour": "red"})
    assert locs(info.value) == [("input", "colour"), ("input", "prompt")]
    assert "must be text, got int" in str(info.value)
    with pytest.raises(InvalidRequest, match="input.prompt: is required"):
        validate_input(T2I, {})
    with pytest.raises(InvalidRequest, match="must not be empty"):
        validate_input(T2I, {"prompt": "   "})
    with pytest.raises(InvalidRequest, match="at most 2000"):
        validate_input(T2I, {"prompt": "x" * 2001})
    assert validate_input(T2I, {"prompt": "ok"}) == {"prompt": "ok"}


def test_params_merge_defaults_and_overrides() -> None:
    params = resolve_params(T2I, {"dit": {"seed": 7, "height": 32}, "ar": {"max_tokens": 5}})
    assert params["dit"]["seed"] == 7 and params["dit"]["height"] == 32 and params["dit"]["width"] == 64
    assert params["ar"]["max_tokens"] == 5 and "{prompt}" in params["ar"]["prompt_template"]


@pytest.mark.parametrize(
    ("params", "loc", "fragment"),
    [
        ({"dit": {"num_inference_steps": -1}}, ("params", "dit", "num_inference_steps"), "greater than or equal to 1"),
        ({"dit": {"height": 100000}}, ("params", "dit", "height"), "less than or equal to 2048"),
        ({"dit": {"width": 33}}, ("params", "dit", "width"), "multiple of 8"),
        ({"dit": {"seed": "abc"}}, ("params", "dit", "seed"), "valid integer"),
        ({"ar": {"temperature": 9}}, ("params", "ar", "temperature"), "less than or equal to 2"),
        ({"ar": {"prompt_template": "no placeholder"}}, ("params", "ar", "prompt_template"), "{prompt}"),
        ({"vae": {}}, ("params", "vae"), "has no stage 'vae'"),
        ({"dit": {"colour": 1}}, ("params", "dit", "colour"), "Extra inputs"),
    ],
)
def test_params_errors(params: dict, loc: tuple, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        resolve_params(T2I, params)
    assert locs(info.value) == [loc]
    assert fragment in info.value.errors[0].message


def test_a_number_out_of_bounds_is_told_all_its_bounds_at_once() -> None:
    """99999 misses the multiple of 8 first; the message names the range too, so the next try is not 100000."""
    with pytest.raises(InvalidRequest) as info:
        resolve_params(T2I, {"dit": {"height": 99999, "guidance_scale": -1.5}, "ar": {"max_tokens": 0}})
    said = {e.loc: e.message for e in info.value.errors}
    assert said[("params", "dit", "height")] == "Input should be a multiple of 8 (allowed: 16 to 2048, a multiple of 8)"
    assert said[("params", "dit", "guidance_scale")].endswith("(allowed: 0 to 50)")
    assert said[("params", "ar", "max_tokens")].startswith("Input should be greater than or equal to 1 (allowed: 1 to ")

    with pytest.raises(InvalidRequest) as info:  # a server that allows less says its own maximum
        resolve_params(T2I, {"dit": {"height": 99999}}, Limits(max_image_side=512))
    assert info.value.errors[0].message.endswith("(allowed: 16 to 512, a multiple of 8)")
