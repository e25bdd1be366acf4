"""Batch files checked line by line (omni_jobs.accept.batch_lines) and a line's result assembled
(omni_jobs.accept.batch_results), with the real catalogue, submitter validation and response shaping."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from omni_jobs.accept.batch_lines import (
    CHAT,
    IMAGES,
    JOBS,
    TRANSCRIPTIONS,
    TRANSLATIONS,
    BatchFileInvalid,
    LinePlanner,
    check_file,
    iter_lines,
)
from omni_jobs.accept.batch_results import Shaping, error_line, line_result
from omni_jobs.accept.submission import JobSubmitter, build_job
from omni_jobs.artifacts import ArtifactRef
from omni_jobs.core.settings import OPENAI_MODEL_NAMES, Settings
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.models import Job, JobError, JobOutput, JobStatus
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.pipelines.limits import Limits
from tests.media_files import wav


@pytest.fixture(scope="module")
def planner() -> LinePlanner:
    catalogue = load_catalogue()
    submitter = JobSubmitter(JobLedger(MemoryJobStore()), catalogue, limits=Limits.from_settings(Settings()))
    return LinePlanner(catalogue, submitter, OPENAI_MODEL_NAMES, max_outputs=4)


def jsonl(*rows: Any) -> bytes:
    return b"".join((row if isinstance(row, bytes) else json.dumps(row).encode()) + b"\n" for row in rows)


def chat_line(custom_id: str, text: str = "hello", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": "text-to-text", "messages": [{"role": "user", "content": text}], **body}}


def refused(planner: LinePlanner, data: bytes, *, max_lines: int = 100) -> BatchFileInvalid:
    with pytest.raises(BatchFileInvalid) as caught:
        check_file(data, planner.plan, max_lines=max_lines)
    return caught.value


def test_a_good_file_is_counted_with_its_endpoints(planner: LinePlanner) -> None:
    data = jsonl(chat_line("a"), chat_line("b", max_tokens=8),
                 {"custom_id": "c", "method": "POST", "url": JOBS,
                  "body": {"pipeline": "text-to-image", "input": {"prompt": "a fox"}, "params": {"dit": {"seed": 3}}}})
    summary = check_file(data, planner.plan, max_lines=100)
    assert summary.lines == 3
    assert summary.urls == frozenset({CHAT, JOBS})
    assert [line.custom_id for line in iter_lines(data)] == ["a", "b", "c"]


def test_each_fault_is_named_with_its_line_number(planner: LinePlanner) -> None:
    data = jsonl(chat_line("ok"),
                 b"{not json",
                 {"method": "POST", "url": CHAT, "body": {}},
                 chat_line("ok"),
                 {"custom_id": "u", "method": "POST", "url": "/v1/embeddings", "body": {}},
                 chat_line("t", max_tokens="7"),
                 {"custom_id": "j", "url": JOBS, "body": {"pipeline": "text-to-image", "input": {"prompt": "x"},
                                                         "params": {"dit": {"height": 100000}}}},
                 chat_line("m", model="no-such-model"))
    exc = refused(planner, data)
    by_line = {e.line: e for e in exc.errors}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7, 8]
    assert exc.total == 7
    assert by_line[2].code == "invalid_json"
    assert by_line[3].code == "missing_custom_id" and by_line[3].param == "custom_id"
    assert by_line[4].code == "duplicate_custom_id" and "first on line 1" in by_line[4].message
    assert by_line[5].code == "invalid_url" and "/v1/embeddings" in by_line[5].message
    assert by_line[6].param == "body.max_tokens"  # the chat route's own model refuses a string
    assert by_line[7].param == "body.params.dit.height"  # the submitter's bound
    assert by_line[8].code == "model_not_found" and by_line[8].param == "body.model"
    assert str(exc).startswith("line 2: is not JSON")


def test_route_rules_hold_in_a_batch(planner: LinePlanner) -> None:
    exc = refused(planner, jsonl(chat_line("s", stream=True),
                                 {"custom_id": "n", "url": IMAGES, "body": {"prompt": "x", "n": 9}},
                                 chat_line("both", max_tokens=4, max_completion_tokens=4),
                                 {"custom_id": "p", "url": JOBS, "body": {"pipeline": "text-to-text",
                                                                          "input": {"prompt": "x"},
                                                                          "priority": "high"}}))
    params = [e.param for e in exc.errors]
    assert params == ["body.stream", "body.n", "body.max_tokens", "body.priority"]
    assert "OMNI_MAX_OUTPUTS" in exc.errors[1].message


def test_limits_and_empty_files(planner: LinePlanner) -> None:
    too_many = refused(planner, jsonl(*(chat_line(str(i)) for i in range(4))), max_lines=3)
    assert too_many.errors[0].code == "too_many_lines" and "OMNI_BATCH_FILE_MAX_LINES" in too_many.errors[0].message
    assert refused(planner, b"\n\n").errors[0].code == "empty_file"
    assert refused(planner, jsonl(chat_line("a")) + b"\xff\xfe\n").errors[0].line == 2


def test_only_the_first_errors_are_listed_and_all_are_counted(planner: LinePlanner) -> None:
    exc = refused(planner, b"x\n" * 50)
    assert len(exc.errors) == 20 and exc.total == 50
    assert "and 49 more faulty lines" in str(exc)


def test_an_images_line_plans_n_jobs_with_consecutive_seeds(planner: LinePlanner) -> None:
    plan = planner.plan(IMAGES, {"prompt": "a fox", "n": 3, "size": "64x64", "seed": 5})
    assert plan.pipeline == "text-to-image" and len(plan.params) == 3
    assert [p["dit"]["seed"] for p in plan.params] == [5, 6, 7]


# --- results ---
def make_job(planner: LinePlanner, job_id: str, pipeline: str, status: JobStatus, **fields: Any) -> Job:
    spec = planner.catalogue.get(pipeline)
    job = build_job(spec, {"prompt": "x"}, {})
    job.id, job.status = job_id, status
    for name, value in fields.items():
        setattr(job, name, value)
    return job


def _ref(key: str, data: bytes, media_type: str) -> ArtifactRef:
    return ArtifactRef.for_bytes("local", key, data, media_type)


def shaping(blobs: dict[str, bytes]) -> Shaping:
    return Shaping(read=lambda ref: blobs[ref.key], present=lambda job: {"id": job.id, "status": job.status.value},
                   url_of=lambda job, name: f"http://api/v1/jobs/{job.id}/outputs/{name}", output_ttl_s=60)


def test_a_chat_line_answers_what_the_chat_route_answers(planner: LinePlanner) -> None:
    (line,) = iter_lines(jsonl(chat_line("c1", max_tokens=8)))
    plan = planner.plan(line.url, line.body)
    document = json.dumps({"text": "Once", "finish_reason": "length",
                           "usage": {"prompt_tokens": 3, "completion_tokens": 8}}).encode()
    job = make_job(planner, "job_1", "text-to-text", JobStatus.succeeded, created_at=100.0)
    job.stage_record("ar").outputs["text"] = _ref("t", document, "application/json")
    job.outputs = [JobOutput(name="text", type="text", media_type="application/json", text="Once",
                             artifact=_ref("o", b"{}", "application/json"), size=2)]
    ok, result = line_result("batch_x", line, plan, [job], shaping({"t": document}))
    assert ok
    assert result["id"] == "batch_req_x_0" and result["custom_id"] == "c1" and result["error"] is None
    response = result["response"]
    assert response["status_code"] == 200 and response["request_id"] == "job_1"
    body = response["body"]
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-job_1"
    assert body["choices"][0]["message"]["content"] == "Once"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}


def test_failed_and_vanished_jobs_are_error_lines(planner: LinePlanner) -> None:
    (line,) = iter_lines(jsonl(chat_line("c2")))
    plan = planner.plan(line.url, line.body)
    failed = make_job(planner, "job_2", "text-to-text", JobStatus.failed,
                 error=JobError(stage="ar", type="EngineError", message="out of memory"))
    ok, result = line_result("batch_x", line, plan, [failed], shaping({}))
    assert not ok
    assert result["response"]["status_code"] == 500
    assert result["response"]["body"]["error"]["code"] == "job_failed"
    assert "out of memory" in result["response"]["body"]["error"]["message"]
    ok, gone = line_result("batch_x", line, plan, [None], shaping({}))
    assert not ok and gone["response"] is None and gone["error"]["code"] == "job_gone"
    assert error_line("batch_x", line, "batch_cancelled", "m") == {
        "id": "batch_req_x_0", "custom_id": "c2", "response": None, "error": {"code": "batch_cancelled", "message": "m"}}


def test_an_images_line_carries_every_jobs_image(planner: LinePlanner) -> None:
    (line,) = iter_lines(jsonl({"custom_id": "i", "url": IMAGES, "body": {"prompt": "x", "n": 2, "size": "64x64"}}))
    plan = planner.plan(line.url, line.body)
    jobs, blobs = [], {}
    for n in range(2):
        png = f"png{n}".encode()
        blobs[f"img{n}"] = png
        job = make_job(planner, f"job_i{n}", "text-to-image", JobStatus.succeeded, created_at=5.0)
        job.outputs = [JobOutput(name="image", type="image", media_type="image/png", width=64, height=64,
                                 artifact=_ref(f"img{n}", png, "image/png"), size=len(png))]
        jobs.append(job)
    ok, result = line_result("batch_x", line, plan, list(jobs), shaping(blobs))
    assert ok and result["response"]["request_id"] == "job_i0,job_i1"
    body = result["response"]["body"]
    assert [base64.b64decode(d["b64_json"]) for d in body["data"]] == [b"png0", b"png1"]
    assert body["size"] == "64x64"


def test_a_job_line_answers_the_job_object(planner: LinePlanner) -> None:
    (line,) = iter_lines(jsonl({"custom_id": "j", "url": JOBS,
                                "body": {"pipeline": "text-to-text", "input": {"prompt": "x"}}}))
    plan = planner.plan(line.url, line.body)
    done = make_job(planner, "job_j", "text-to-text", JobStatus.succeeded)
    ok, result = line_result("batch_x", line, plan, [done], shaping({}))
    assert ok and result["response"]["body"] == {"id": "job_j", "status": "succeeded"}
    canceled = make_job(planner, "job_k", "text-to-text", JobStatus.canceled)
    ok, result = line_result("batch_x", line, plan, [canceled], shaping({}))
    assert not ok and result["response"]["body"]["error"]["code"] == "job_canceled"
    assert result["response"]["body"]["job"] == {"id": "job_k", "status": "canceled"}


def test_a_transcription_line_is_the_routes_form_with_its_audio_as_a_file_input(planner: LinePlanner) -> None:
    audio = "data:audio/wav;base64," + base64.b64encode(wav(0.5)).decode()
    plan = planner.plan(TRANSCRIPTIONS, {"model": "whisper-1", "file": audio, "language": "en",
                                         "response_format": "srt", "temperature": 0})
    assert plan.pipeline == "speech-to-text" and plan.form is not None and plan.form.response_format == "srt"
    assert plan.input == {"audio": audio}
    assert plan.params == [{"asr": {"task": "transcribe", "language": "en", "temperature": 0.0}}]
    translated = planner.plan(TRANSLATIONS, {"model": "speech-to-text", "file": audio})
    assert translated.params == [{"asr": {"task": "translate"}}]
    exc = refused(planner, jsonl({"custom_id": "nofile", "url": TRANSCRIPTIONS, "body": {"model": "whisper-1"}},
                                 {"custom_id": "fmt", "url": TRANSCRIPTIONS,
                                  "body": {"model": "whisper-1", "file": audio, "response_format": "mp3"}},
                                 {"custom_id": "notaudio", "url": TRANSCRIPTIONS,
                                  "body": {"model": "whisper-1", "file": 7}}))
    assert [(e.line, e.param) for e in exc.errors] == [(1, "body.file"), (2, "body.response_format"),
                                                       (3, "body.file")]
