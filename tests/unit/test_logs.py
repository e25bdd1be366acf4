"""Structured logs carry the job id, stage and task id from context; task names carry the job id."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator

import pytest

from omni_jobs.core.logs import bind, current_context, log_context, make_handler
from omni_jobs.jobs.steps import ASSEMBLE_RESULTS_TASK, DELIVER_WEBHOOK_TASK, RUN_STAGE_TASK, display_name, task_subject


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    logger = logging.getLogger("test.omni.logs")
    handler = make_handler("json", service="worker", stream=stream)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield logger, stream
    finally:
        logger.removeHandler(handler)


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_the_context_ids_and_extras(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    logger.info("before")
    with log_context(job_id="job_abc", stage="dit", task_id="t-1"):
        logger.info("stage %s done", "dit", extra={"duration_ms": 12.5, "data": {"k": [1, 2]}})
        with log_context(stage="results"):
            logger.warning("inner")
    logger.info("after")
    before, during, inner, after = lines(stream)
    assert "job_id" not in before and "job_id" not in after and current_context() == {}
    assert during["message"] == "stage dit done" and during["level"] == "INFO"
    assert (during["job_id"], during["stage"], during["task_id"]) == ("job_abc", "dit", "t-1")
    assert during["duration_ms"] == 12.5 and during["data"] == {"k": [1, 2]}
    assert during["service"] == "worker" and during["logger"] == "test.omni.logs" and during["ts"].endswith("Z")
    assert (inner["job_id"], inner["stage"], inner["level"]) == ("job_abc", "results", "WARNING")


def test_exceptions_are_one_json_line(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    try:
        raise ValueError("bad shape [2, 3]")
    except ValueError:
        logger.exception("stage failed")
    (entry,) = lines(stream)
    assert entry["exc_type"] == "ValueError" and "bad shape [2, 3]" in entry["exc"] and "Traceback" in entry["exc"]


def test_bind_and_reset_across_callbacks_and_threads(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    reset = bind(job_id="job_1", task_id="t-9")  # as Celery's task_prerun does
    seen: list[dict[str, str]] = []
    thread = threading.Thread(target=lambda: seen.append(current_context()))
    thread.start()
    thread.join()
    logger.info("in task")
    reset()  # task_postrun
    logger.info("between tasks")
    in_task, between = lines(stream)
    assert in_task["job_id"] == "job_1" and "job_id" not in between
    assert seen == [{}]  # another thread does not inherit a worker thread's job


@pytest.mark.parametrize(
    ("name", "args", "subject", "shown"),
    [
        (RUN_STAGE_TASK, ["job_1a", "dit"], ("job_1a", "dit"), "omni.run_stage[job_1a/dit]"),
        (ASSEMBLE_RESULTS_TASK, ["job_1a"], ("job_1a", "results"), "omni.assemble_results[job_1a]"),
        (DELIVER_WEBHOOK_TASK, ["job_1a", "msg_1", "completed"], ("job_1a", "webhook:completed"),
         "omni.deliver_webhook[job_1a/webhook:completed]"),
        ("omni.cleanup", [], (None, None), "omni.cleanup"),
        ("omni.other", ["not-a-job"], (None, None), "omni.other"),
    ],
)
def test_task_names_carry_the_job_id(name: str, args: list[str], subject: tuple[str | None, str | None],
                                     shown: str) -> None:
    assert task_subject(name, args) == subject
    assert display_name(name, args) == shown
