"""Jobs through the HTTP API with real Celery workers, vLLM, diffusers, Redis and S3."""

from __future__ import annotations

import io
from typing import Any

import httpx
import pytest
import redis
from PIL import Image

from omni_jobs.core import keys
from tests.e2e.helpers import submit, wait_for_job


def png(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    assert image.format == "PNG"
    return image


def download(api: httpx.Client, url: str) -> bytes:
    return httpx.get(url, timeout=30).raise_for_status().content


def test_text_to_image_end_to_end(api: httpx.Client) -> None:
    response = api.post(
        "/v1/jobs",
        json={"pipeline": "text-to-image", "input": {"prompt": "a red fox in the snow"},
              "params": {"dit": {"height": 48, "width": 64, "num_inference_steps": 4, "seed": 3}}},
    )
    assert response.status_code == 202
    accepted = response.json()
    assert accepted["status"] == "queued" and accepted["id"].startswith("job_")
    assert response.headers["location"] == f"/v1/jobs/{accepted['id']}"
    assert accepted["params"]["dit"]["height"] == 48 and accepted["params"]["dit"]["guidance_scale"] == 4.5

    job = wait_for_job(api, accepted["id"])
    assert job["status"] == "succeeded", job["error"]
    assert job["error"] is None and job["stage"] is None

    outputs = {o["name"]: o for o in job["outputs"]}
    assert set(outputs) == {"image", "text"}
    image_out = outputs["image"]
    assert (image_out["type"], image_out["media_type"]) == ("image", "image/png")
    assert (image_out["width"], image_out["height"]) == (64, 48)
    data = download(api, image_out["url"])  # presigned S3 URL
    assert "X-Amz-Signature" in image_out["url"] and len(data) == image_out["size"]
    image = png(data)
    assert image.size == (64, 48) and image.mode == "RGB"
    assert len(set(image.getdata())) > 50  # a rendered image, not a blank one
    assert api.get(f"/v1/jobs/{job['id']}/outputs/image").content == data

    text_out = outputs["text"]
    assert text_out["type"] == "text" and isinstance(text_out["text"], str) and text_out["text"]
    ar_text = api.get(f"/v1/jobs/{job['id']}/outputs/text").json()
    assert ar_text == {"text": text_out["text"]}

    # The timeline: created <= ar queued <= ar started < ar finished <= dit queued <= dit started < done.
    ar, dit = job["stages"]
    assert (ar["id"], dit["id"]) == ("ar", "dit")
    assert ar["status"] == dit["status"] == "succeeded"
    assert ar["worker"].startswith("ar@") and dit["worker"].startswith("dit@")
    assert ar["attempts"] == dit["attempts"] == 1
    ts = [job["created_at"], ar["queued_at"], ar["started_at"], ar["finished_at"], dit["queued_at"],
          dit["started_at"], dit["finished_at"], job["completed_at"]]
    assert ts == sorted(ts), ts
    for stage in (ar, dit):
        assert stage["duration_s"] == pytest.approx(stage["finished_at"] - stage["started_at"])
        assert 0 < stage["metrics"]["engine_s"] <= stage["duration_s"]
    assert set(ar["outputs"]) == {"text", "token_ids"} and set(dit["outputs"]) == {"image"}
    # Small intermediates stayed in Redis, the image went to S3 (threshold 2048 bytes in conftest).
    assert ar["outputs"]["text"]["backend"] == "redis" and dit["outputs"]["image"]["backend"] == "s3"
    metrics = job["metrics"]
    assert metrics["total_time_s"] == pytest.approx(job["completed_at"] - job["created_at"])
    assert metrics["total_time_s"] >= ar["duration_s"] + dit["duration_s"]
    assert job["urls"]["get"].endswith(f"/v1/jobs/{job['id']}")


def test_same_seed_same_image_bytes(api: httpx.Client) -> None:
    params = {"dit": {"height": 32, "width": 32, "num_inference_steps": 3, "seed": 11}}
    jobs = [submit(api, "text-to-image", "a blue square", params) for _ in range(2)]
    other = submit(api, "text-to-image", "a blue square", {"dit": {**params["dit"], "seed": 12}})
    done = [wait_for_job(api, j["id"]) for j in [*jobs, other]]
    assert [d["status"] for d in done] == ["succeeded"] * 3
    images = [download(api, {o["name"]: o for o in d["outputs"]}["image"]["url"]) for d in done]
    texts = [{o["name"]: o for o in d["outputs"]}["text"]["text"] for d in done]
    assert images[0] == images[1]
    assert images[0] != images[2]
    assert texts[0] == texts[1] == texts[2]  # greedy AR stage: the seed only changes the image


def test_text_to_text(api: httpx.Client) -> None:
    job = wait_for_job(api, submit(api, "text-to-text", "Once upon a time", {"ar": {"max_tokens": 8}})["id"])
    assert job["status"] == "succeeded"
    (out,) = job["outputs"]
    assert out["name"] == "text" and out["text"]
    assert [s["id"] for s in job["stages"]] == ["ar"]
    assert job["params"]["ar"]["max_tokens"] == 8


@pytest.mark.parametrize(
    ("body", "loc", "fragment"),
    [
        ({"pipeline": "no-such", "input": {"prompt": "x"}}, ["body", "pipeline"], "unknown pipeline 'no-such'"),
        ({"pipeline": "text-to-image", "input": {}}, ["body", "input", "prompt"], "is required"),
        ({"pipeline": "text-to-image", "input": {"prompt": 42}}, ["body", "input", "prompt"], "must be text"),
        ({"pipeline": "text-to-image", "input": {"prompt": "x"}, "params": {"dit": {"num_inference_steps": -2}}},
         ["body", "params", "dit", "num_inference_steps"], "greater than or equal to 1"),
        ({"pipeline": "text-to-image", "input": {"prompt": "x"}, "params": {"dit": {"width": 100000}}},
         ["body", "params", "dit", "width"], "less than or equal to 2048"),
        ({"pipeline": "text-to-image", "input": {"prompt": "x"}, "params": {"dit": {"height": 50}}},
         ["body", "params", "dit", "height"], "multiple of 8"),
        ({"pipeline": "text-to-image", "input": {"prompt": "x"}, "params": {"unet": {}}},
         ["body", "params", "unet"], "has no stage 'unet'"),
        ({"pipeline": "text-to-image", "input": {"prompt": "x"}, "priority": "urgent"}, ["body", "priority"],
         "Input should be 'low', 'normal' or 'high'"),
        ({"pipeline": "text-to-image", "input": {"prompt": "x"}, "prio": "high"}, ["body", "prio"], "Extra inputs"),
        ({"input": {"prompt": "x"}}, ["body", "pipeline"], "Field required"),
    ],
)
def test_bad_input_is_422_naming_the_field(api: httpx.Client, body: dict[str, Any], loc: list[str],
                                           fragment: str) -> None:
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert any(d["loc"] == loc and fragment in d["msg"] for d in detail), detail


JSON = {"content-type": "application/json"}
TEXT_JOB = b'{"pipeline":"text-to-text","input":{"prompt":"raw body"}}'


@pytest.mark.parametrize(
    ("content", "headers", "status", "detail"),
    [
        (b'{"pipeline": ', JSON, 422, {"type": "json_invalid", "loc": ["body", 13], "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": "Expecting value"}}),
        (b"", JSON, 422, {"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}),
        (TEXT_JOB, {"content-type": "text/plain"}, 422, {"type": "model_attributes_type", "loc": ["body"]}),
        (TEXT_JOB, {}, 422, {"type": "model_attributes_type", "loc": ["body"]}),  # no content type: not JSON
        (b"[1, 2]", JSON, 422, {"type": "model_attributes_type", "loc": ["body"], "input": [1, 2]}),
        (b"\xff\xfe{", JSON, 400, "There was an error parsing the body"),
        (TEXT_JOB, {"content-type": "application/vnd.omni+json; charset=utf-8"}, 202, None),
    ],
)
def test_submit_reads_its_body_as_fastapi_would(api: httpx.Client, content: bytes, headers: dict[str, str],
                                                 status: int, detail: object) -> None:
    """POST /v1/jobs reads its own body (api.json_body): the answers FastAPI gave for a body model."""
    response = api.post("/v1/jobs", content=content, headers=headers)
    assert response.status_code == status, response.text
    if isinstance(detail, dict):
        (error,) = response.json()["detail"]
        assert {k: error.get(k) for k in detail} == detail
    elif detail is not None:
        assert response.json()["detail"] == detail


def test_submit_checks_json_syntax_before_the_key_and_the_key_before_the_fields(api: httpx.Client) -> None:
    """FastAPI's order, kept: a body that is not JSON is a 422 whoever sends it; then a bad key is a
    401 whatever the fields say."""
    no_key = {"authorization": "Bearer not-a-key", **JSON}
    syntax = httpx.post(f"{api.base_url}/v1/jobs", content=b"{", headers=no_key)
    assert syntax.status_code == 422 and syntax.json()["detail"][0]["type"] == "json_invalid"
    fields = httpx.post(f"{api.base_url}/v1/jobs", content=b"{}", headers=no_key)
    assert fields.status_code == 401 and fields.headers["www-authenticate"] == 'Bearer error="invalid_token"'
    missing = httpx.post(f"{api.base_url}/v1/jobs", content=b"{}", headers=JSON)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"


def test_half_a_surrogate_pair_in_a_prompt_is_a_422_naming_it(api: httpx.Client) -> None:
    """JSON may escape half a UTF-16 pair (valid JSON, not text any engine can read): refused before
    anything is stored (it was stored and queued, and then the 202 was a 500); a whole pair is text."""
    half = api.post("/v1/jobs", content=b'{"pipeline":"text-to-text","input":{"prompt":"caf\\u00e9 \\ud83d"}}',
                    headers=JSON)
    assert half.status_code == 422, half.text
    (error,) = half.json()["detail"]
    assert error["loc"] == ["body", "input", "prompt"] and "half a surrogate pair at character 5" in error["msg"]
    whole = api.post("/v1/jobs", content=b'{"pipeline":"text-to-text","input":{"prompt":"caf\\u00e9 \\ud83d\\ude00"}}',
                     headers=JSON)
    assert whole.status_code == 202 and whole.json()["input"]["prompt"] == "caf\u00e9 \U0001f600"


def test_engine_error_fails_the_job_with_stage_and_reason(api: httpx.Client) -> None:
    job = wait_for_job(api, submit(api, "broken-model", "hello")["id"])
    assert job["status"] == "failed"
    assert job["error"]["stage"] == "ar"
    assert "/nonexistent/omni-model" in job["error"]["message"]
    assert job["stages"][0]["status"] == "failed" and job["outputs"] == []
    # The worker survived and serves the next job.
    ok = wait_for_job(api, submit(api, "text-to-text", "still alive?", {"ar": {"max_tokens": 4}})["id"])
    assert ok["status"] == "succeeded"


def test_list_is_paginated_newest_first(api: httpx.Client) -> None:
    ids = [submit(api, "text-to-text", f"page {i}", {"ar": {"max_tokens": 2}})["id"] for i in range(3)]
    first = api.get("/v1/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in first["data"]] == ids[::-1][:2]
    assert first["next_cursor"]
    second = api.get("/v1/jobs", params={"limit": 2, "cursor": first["next_cursor"]}).json()
    assert second["data"][0]["id"] == ids[0]
    for i in ids:
        wait_for_job(api, i)
    succeeded = api.get("/v1/jobs", params={"limit": 100, "status": "succeeded"}).json()["data"]
    assert {j["status"] for j in succeeded} == {"succeeded"} and set(ids) <= {j["id"] for j in succeeded}


def test_unknown_job_is_404_and_finished_job_cannot_be_canceled(api: httpx.Client) -> None:
    assert api.get("/v1/jobs/job_doesnotexist").status_code == 404
    assert api.get("/v1/jobs/job_doesnotexist/outputs/image").status_code == 404
    job = wait_for_job(api, submit(api, "text-to-text", "done soon", {"ar": {"max_tokens": 2}})["id"])
    response = api.post(f"/v1/jobs/{job['id']}/cancel")
    assert response.status_code == 409 and "already succeeded" in response.json()["detail"]


def test_a_look_at_a_job_not_yet_ended_asks_its_workers_for_frequent_progress(api: httpx.Client, system: Any) -> None:
    """A GET of a job still queued or running, or a cancel, marks it looked at for 10 s (its workers
    write its progress every OMNI_PROGRESS_INTERVAL_S, not every OMNI_PROGRESS_UNFOLLOWED_INTERVAL_S);
    a GET of an ended job marks nothing."""
    client = redis.Redis.from_url(system.redis_url)
    job = submit(api, "text-to-text", "a long count", {"ar": {"max_tokens": 400}})
    mark = keys.job_followed(job["id"])
    assert client.exists(mark) == 0  # submitting is not looking
    assert api.get(f"/v1/jobs/{job['id']}").json()["status"] in ("queued", "running")
    assert 0 < client.ttl(mark) <= 10 and client.get(mark) == b"look"
    client.delete(mark)
    assert api.post(f"/v1/jobs/{job['id']}/cancel").json()["status"] == "canceled"
    assert 0 < client.ttl(mark) <= 10 and client.get(mark) == b"look"  # written with the cancel: a running stage notices it at once
    client.delete(mark)
    assert api.get(f"/v1/jobs/{job['id']}").status_code == 200
    assert client.exists(mark) == 0


def test_pipelines_endpoint_describes_the_catalogue(api: httpx.Client) -> None:
    pipelines = {p["name"]: p for p in api.get("/v1/pipelines").json()}
    assert {"text-to-text", "text-to-image", "broken-model"} <= set(pipelines)
    t2i = api.get("/v1/pipelines/text-to-image").json()
    assert [(s["id"], s["engine"], s["queue"]) for s in t2i["stages"]] == [("ar", "ar", "ar"), ("dit", "dit", "dit")]
    assert t2i["stages"][1]["inputs"] == {"prompt": "ar.text"}
    assert t2i["outputs"] == [{"name": "image", "from": "dit.image", "type": "image"},
                              {"name": "text", "from": "ar.text", "type": "text"}]
    missing = api.get("/v1/pipelines/no-such-pipeline")
    assert missing.status_code == 404  # a missing resource in the path, not a 422
    assert "no-such-pipeline" in missing.json()["detail"] and "text-to-image" in missing.json()["detail"]


def test_flower_is_behind_basic_auth_and_sees_workers_and_tasks(api: httpx.Client, system: Any) -> None:
    flower = httpx.Client(base_url=system.flower_url, auth=(system.flower_user, system.flower_password), timeout=30)
    assert httpx.get(f"{system.flower_url}/api/workers", timeout=10).status_code == 401
    workers = flower.get("/api/workers", params={"refresh": 1}).json()
    assert {n.split("@")[0] for n in workers} >= {"ar", "dit", "results"}, workers
    job = wait_for_job(api, submit(api, "text-to-text", "for flower", {"ar": {"max_tokens": 2}})["id"])
    tasks = flower.get("/api/tasks").json()
    mine = {uuid: t for uuid, t in tasks.items() if job["id"] in str(t.get("args"))}
    # Task ids are the steps' ids (slot and attempt), so an operator finds a job's tasks by its id. The
    # results step ran inline in the AR task (OMNI_RESULTS_INLINE): no task of its own.
    assert set(mine) == {f"stage:{job['id']}:ar:1"}, mine
    assert {t["state"] for t in mine.values()} == {"SUCCESS"}
