"""OpenAI's Files and Batch APIs against the real system: the ``openai`` client's files.create,
batches.create, retrieve, cancel and files.content unchanged, real workers running every line as a
low-priority job, results compared with the synchronous route's answer, and the batch webhooks
verified with the ``standardwebhooks`` library."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types import Batch
from PIL import Image
from standardwebhooks.webhooks import Webhook

from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.conftest import WEBHOOK_SECRETS, auth_headers
from tests.media_files import wav
from tests.webhook_receiver import WebhookReceiver


@pytest.fixture
def client(system: EmbeddedSystem) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{system.api_url}/v1", api_key=system.api_key, timeout=60) as c:
        yield c


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def chat(custom_id: str, prompt: str, model: str = "text-to-text") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": 6, "temperature": 0, "seed": 1,
                     "messages": [{"role": "user", "content": prompt}]}}


def dit_job(custom_id: str, seed: int) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/jobs",
            "body": {"pipeline": "dit-only", "input": {"prompt": f"a fox {seed}"}, "params": {"dit": {"seed": seed}}}}


def wait_until_ended(client: OpenAI, batch_id: str, timeout_s: float = 300) -> Batch:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s}s: {batch.request_counts}")


def lines_of(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


def test_a_file_is_checked_kept_and_deleted(api: httpx.Client, system: EmbeddedSystem) -> None:
    data = jsonl([chat("a", "hi"), chat("b", "there")])
    made = api.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    assert made.status_code == 200, made.text
    record = made.json()
    assert record["object"] == "file" and record["bytes"] == len(data) and record["purpose"] == "batch"
    assert record["filename"] == "in.jsonl" and record["status"] == "processed"
    assert api.get(f"/v1/files/{record['id']}").json() == record
    content = api.get(f"/v1/files/{record['id']}/content")
    assert content.content == data
    assert record["id"] in [f["id"] for f in api.get("/v1/files").json()["data"]]
    with httpx.Client(base_url=str(api.base_url), timeout=30,
                      headers=auth_headers(system.create_api_key(f"other-{time.time_ns()}"))) as other:
        for path in (f"/v1/files/{record['id']}", f"/v1/files/{record['id']}/content"):
            assert other.get(path).status_code == 404  # another tenant's file is nobody's
        assert other.delete(f"/v1/files/{record['id']}").status_code == 404
        assert record["id"] not in [f["id"] for f in other.get("/v1/files").json()["data"]]
    assert api.delete(f"/v1/files/{record['id']}").json() == {"id": record["id"], "object": "file", "deleted": True}
    gone = api.get(f"/v1/files/{record['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "file_not_found"


def test_a_bad_file_is_refused_with_its_line_numbers(api: httpx.Client) -> None:
    data = jsonl([chat("a", "hi"), chat("a", "again"), {"custom_id": "u", "url": "/v1/embeddings", "body": {}},
                  chat("m", "x", model="no-such-model")]) + b"{oops\n"
    refused = api.post("/v1/files", files={"file": ("bad.jsonl", data)}, data={"purpose": "batch"})
    assert refused.status_code == 400
    body = refused.json()
    assert body["error"]["code"] == "invalid_batch_file" and body["error"]["param"] == "file"
    assert [(e["line"], e["code"]) for e in body["errors"]["data"]] == [
        (2, "duplicate_custom_id"), (3, "invalid_url"), (4, "model_not_found"), (5, "invalid_json")]
    assert body["errors"]["total"] == 4
    wrong_purpose = api.post("/v1/files", files={"file": ("in.jsonl", jsonl([chat("a", "x")]))},
                             data={"purpose": "fine-tune"})
    assert wrong_purpose.status_code == 400 and wrong_purpose.json()["error"]["param"] == "purpose"


def test_a_batch_is_refused_when_its_endpoint_is_not_every_lines(api: httpx.Client) -> None:
    data = jsonl([chat("a", "hi"), dit_job("b", 1)])
    file_id = api.post("/v1/files", files={"file": ("mixed.jsonl", data)}, data={"purpose": "batch"}).json()["id"]
    refused = api.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "mismatched_endpoint" and "lines 2 " in refused.json()["error"]["message"]
    for field, value in (("completion_window", "1h"), ("endpoint", "/v1/embeddings")):
        body = {"input_file_id": file_id, "endpoint": "/v1/jobs", "completion_window": "24h", field: value}
        answer = api.post("/v1/batches", json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field
    missing = api.post("/v1/batches", json={"input_file_id": "file-nope", "endpoint": "/v1/jobs",
                                            "completion_window": "24h"})
    assert missing.status_code == 404


def test_a_chat_batch_with_the_openai_client(client: OpenAI, api: httpx.Client) -> None:
    rows = [chat(f"req-{i}", f"Once upon a time {i}") for i in range(6)]
    rows.append(chat("broken", "this model cannot load", model="broken-model"))
    uploaded = client.files.create(file=("chat.jsonl", jsonl(rows)), purpose="batch")
    assert uploaded.object == "file" and uploaded.bytes == len(jsonl(rows))
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "e2e"})
    assert batch.object == "batch" and batch.status == "validating" and batch.metadata == {"run": "e2e"}
    assert batch.request_counts is not None and batch.request_counts.total == 7
    ended = wait_until_ended(client, batch.id)
    assert ended.status == "completed"
    assert ended.request_counts is not None
    assert (ended.request_counts.total, ended.request_counts.completed, ended.request_counts.failed) == (7, 6, 1)
    assert ended.in_progress_at and ended.finalizing_at and ended.completed_at
    assert ended.created_at <= ended.in_progress_at <= ended.finalizing_at <= ended.completed_at
    outputs, errors = lines_of(client, ended.output_file_id), lines_of(client, ended.error_file_id)
    assert [o["custom_id"] for o in outputs] == [f"req-{i}" for i in range(6)]  # line order, each once
    assert [e["custom_id"] for e in errors] == ["broken"]
    assert errors[0]["response"]["status_code"] == 500
    assert errors[0]["response"]["body"]["error"]["code"] == "job_failed"
    # each answer is the chat route's for the same request (same seed, temperature 0, one job in flight)
    first = outputs[0]["response"]
    assert first["status_code"] == 200
    job = api.get(f"/v1/jobs/{first['request_id']}").json()
    assert job["priority"] == "low" and job["status"] == "succeeded"
    same = client.chat.completions.create(**rows[0]["body"])
    body = first["body"]
    assert body["object"] == "chat.completion" and body["id"] == f"chatcmpl-{first['request_id']}"
    assert body["choices"][0]["message"]["content"] == same.choices[0].message.content
    assert body["choices"][0]["finish_reason"] == same.choices[0].finish_reason
    assert body["usage"] == same.usage.model_dump(exclude_none=True) if same.usage else body["usage"] is None
    listed = client.batches.list(limit=5)
    assert batch.id in [b.id for b in listed.data]


def test_an_images_batch_runs_n_jobs_a_line(client: OpenAI) -> None:
    rows = [{"custom_id": "img", "method": "POST", "url": "/v1/images/generations",
             "body": {"model": "dit-only", "prompt": "a lighthouse", "n": 2, "size": "32x32", "seed": 3}}]
    uploaded = client.files.create(file=("img.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/images/generations",
                                  completion_window="24h")
    ended = wait_until_ended(client, batch.id)
    assert ended.status == "completed" and ended.error_file_id is None
    (line,) = lines_of(client, ended.output_file_id)
    assert len(line["response"]["request_id"].split(",")) == 2
    images = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in line["response"]["body"]["data"]]
    assert [image.size for image in images] == [(32, 32), (32, 32)]
    with pytest.raises(openai.ConflictError) as err:  # a completed batch cannot be cancelled
        client.batches.cancel(batch.id)
    assert err.value.code == "batch_not_cancellable"


def test_a_cancelled_batch_accounts_for_every_line(client: OpenAI, system: EmbeddedSystem) -> None:
    rows = [dit_job(f"j{i}", i) for i in range(40)]
    uploaded = client.files.create(file=("dit.jsonl", jsonl(rows)), purpose="batch")
    receiver = WebhookReceiver().__enter__()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h",
                                  extra_body={"webhook": receiver.script("/cancelled", [])})
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).status == "validating" and time.monotonic() < deadline:
        time.sleep(0.2)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    ended = wait_until_ended(client, batch.id)
    assert ended.status == "cancelled" and ended.cancelled_at
    outputs, errors = lines_of(client, ended.output_file_id), lines_of(client, ended.error_file_id)
    ids = [row["custom_id"] for row in outputs + errors]
    assert sorted(ids) == sorted(r["custom_id"] for r in rows) and len(ids) == len(set(ids))
    assert ended.request_counts is not None
    assert ended.request_counts.completed == len(outputs) and ended.request_counts.failed == len(errors)
    assert ended.request_counts.completed + ended.request_counts.failed == ended.request_counts.total == 40
    assert errors, "a batch of 40 DiT jobs cancelled at once leaves some lines unrun"
    codes = {(e["error"] or {}).get("code") or e["response"]["body"]["error"]["code"] for e in errors}
    assert codes <= {"batch_cancelled", "job_canceled"}
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelled again: answered as it is
    try:
        receiver.wait_until(lambda: bool(receiver.at("/cancelled")), timeout_s=60, what="batch.cancelled")
        (got,) = receiver.at("/cancelled")
        event = Webhook(WEBHOOK_SECRETS[0]).verify(got.body, got.headers)
        assert event["type"] == "batch.cancelled" and event["data"]["request_counts"]["total"] == 40
    finally:
        receiver.__exit__()
    with httpx.Client(base_url=system.api_url, timeout=30,
                      headers=auth_headers(system.create_api_key(f"other-{time.time_ns()}"))) as other:
        assert other.get(f"/v1/batches/{batch.id}").status_code == 404  # another tenant's batch is nobody's
        assert other.post(f"/v1/batches/{batch.id}/cancel").status_code == 404


def test_a_batch_announces_its_end_with_a_signed_webhook(client: OpenAI) -> None:
    with WebhookReceiver() as receiver:
        url = receiver.script("/batch", [])
        uploaded = client.files.create(file=("w.jsonl", jsonl([dit_job("w", 5)])), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h",
                                      extra_body={"webhook": url})
        receiver.wait_until(lambda: bool(receiver.at("/batch")), timeout_s=120, what="the batch webhook")
        (got,) = receiver.at("/batch")
        event = Webhook(WEBHOOK_SECRETS[0]).verify(got.body, got.headers)
        assert Webhook(WEBHOOK_SECRETS[1]).verify(got.body, got.headers) == event
        assert event["type"] == "batch.completed" and got.headers["omni-webhook-event"] == "batch.completed"
        assert event["data"]["id"] == batch.id and event["data"]["status"] == "completed"
        assert event["data"]["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
        time.sleep(2)
        assert len(receiver.at("/batch")) == 1  # delivered once


def test_a_transcriptions_batch_answers_as_the_route_does(client: OpenAI) -> None:
    audio = "data:audio/wav;base64," + base64.b64encode(wav(1.0)).decode()
    rows = [{"custom_id": fmt, "method": "POST", "url": "/v1/audio/transcriptions",
             "body": {"model": "whisper-1", "file": audio, "response_format": fmt}} for fmt in ("json", "srt")]
    uploaded = client.files.create(file=("asr.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/audio/transcriptions",
                                  completion_window="24h")
    ended = wait_until_ended(client, batch.id)
    assert ended.status == "completed" and ended.error_file_id is None
    as_json, as_srt = lines_of(client, ended.output_file_id)
    assert as_json["custom_id"] == "json" and as_srt["custom_id"] == "srt"
    text = as_json["response"]["body"]["text"]
    assert as_json["response"]["body"]["usage"] == {"type": "duration", "seconds": 1.0}
    with io.BytesIO(wav(1.0)) as f:
        same = client.audio.transcriptions.create(model="whisper-1", file=("a.wav", f))
    assert same.text == text
    assert isinstance(as_srt["response"]["body"], str)
    if text.strip():
        assert as_srt["response"]["body"].startswith("1\n00:00:00,000 --> 00:00:01,000\n")
