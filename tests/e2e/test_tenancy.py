"""Tenancy and secrets on the real system (API + Celery workers + moto S3, auth on as deployed):
a tenant sees, lists, cancels, streams and downloads only its own jobs and outputs; another
tenant's job is 404 like an unknown one; no secret reaches a log file or a job's JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.conftest import S3_SECRET, WEBHOOK_SECRETS, auth_headers
from tests.e2e.helpers import submit, wait_for_job

MISSING = "job_000000000000000000000000"


@pytest.fixture(scope="module")
def other_key(system: EmbeddedSystem) -> str:
    return system.create_api_key("tenant-b", "test_tenancy")


@pytest.fixture
def other(system: EmbeddedSystem, other_key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=system.api_url, timeout=30, headers=auth_headers(other_key)) as client:
        yield client


@pytest.fixture(scope="module")
def finished_job(system: EmbeddedSystem) -> dict[str, object]:
    with httpx.Client(base_url=system.api_url, timeout=30, headers=auth_headers(system.api_key)) as api:
        job = submit(api, "text-to-image", "a tenant's lighthouse",
                     {"dit": {"height": 32, "width": 32, "num_inference_steps": 2, "seed": 1}, "ar": {"max_tokens": 4}})
        done = wait_for_job(api, job["id"])
    assert done["status"] == "succeeded", done
    return done


def test_without_a_valid_key_the_api_answers_401(system: EmbeddedSystem, finished_job: dict[str, object]) -> None:
    for headers in ({}, {"authorization": "Bearer ok_0123456789abcdef_" + "A" * 43}):
        response = httpx.get(f"{system.api_url}/v1/jobs/{finished_job['id']}", headers=headers, timeout=10)
        assert response.status_code == 401 and response.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(f"{system.api_url}/healthz", timeout=10).status_code == 200


def test_another_tenants_job_is_404_everywhere_like_an_unknown_one(
        api: httpx.Client, other: httpx.Client, finished_job: dict[str, object]) -> None:
    job_id = str(finished_job["id"])
    assert finished_job["tenant"] == "demo"
    for method, path in (("GET", "/v1/jobs/{}"), ("POST", "/v1/jobs/{}/cancel"), ("GET", "/v1/jobs/{}/events"),
                         ("GET", "/v1/jobs/{}/outputs/image")):
        theirs = other.request(method, path.format(job_id))
        unknown = other.request(method, path.format(MISSING))
        assert theirs.status_code == unknown.status_code == 404, (method, path, theirs.text)
        assert theirs.json()["detail"].replace(job_id, MISSING) == unknown.json()["detail"]
    assert job_id not in {j["id"] for j in other.get("/v1/jobs", params={"limit": 100}).json()["data"]}
    assert job_id in {j["id"] for j in api.get("/v1/jobs", params={"limit": 100}).json()["data"]}
    assert api.get(f"/v1/jobs/{job_id}/outputs/image").status_code == 200  # the owner downloads it


def test_another_tenants_outputs_cannot_be_used_as_image_input(
        api: httpx.Client, other: httpx.Client, system: EmbeddedSystem, finished_job: dict[str, object]) -> None:
    job_id = str(finished_job["id"])
    image = next(o for o in finished_job["outputs"] if o["name"] == "image")  # type: ignore[attr-defined]
    forms = [{"job_id": job_id, "output": "image"}, f"{system.api_url}/v1/jobs/{job_id}/outputs/image",
             {"artifact": {"backend": "s3", "key": f"jobs/{job_id}/outputs/image.png", "media_type": "image/png",
                           "size": image["size"], "sha256": "0" * 64}}]
    for form in forms:
        body = {"pipeline": "image-to-image", "input": {"prompt": "steal", "image": form},
                "params": {"dit": {"seed": 2, "strength": 0.5}}}
        refused = other.post("/v1/jobs", json=body)
        assert refused.status_code == 422, (form, refused.text)
        assert refused.json()["detail"][0]["loc"] == ["body", "input", "image"]
        assert "does not exist" in refused.text
    own = api.post("/v1/jobs", json={"pipeline": "image-to-image", "input": {"prompt": "mine", "image": forms[0]},
                                     "params": {"dit": {"seed": 2, "strength": 0.5}}})
    assert own.status_code == 202, own.text
    assert wait_for_job(api, own.json()["id"])["status"] == "succeeded"


def test_output_urls_are_presigned_and_expire(finished_job: dict[str, object]) -> None:
    for out in finished_job["outputs"]:  # type: ignore[attr-defined]
        query = parse_qs(urlsplit(out["url"]).query)
        assert query["X-Amz-Expires"] == ["3600"] and "X-Amz-Signature" in query, out["url"]


def test_webhooks_to_internal_addresses_are_refused(api: httpx.Client) -> None:
    for url in ("http://10.0.0.1/hook", "https://169.254.169.254/latest/meta-data/", "http://localhost:6379/"):
        response = api.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "x"}, "webhook": url})
        assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "webhook"], url


def test_no_secret_in_logs_or_job_json(system: EmbeddedSystem, api: httpx.Client, other_key: str,
                                       finished_job: dict[str, object]) -> None:
    job = api.get(f"/v1/jobs/{finished_job['id']}").json()
    secrets_ = {"S3 secret": S3_SECRET, "demo API key": system.api_key or "", "tenant-b API key": other_key,
                **{f"webhook secret {i}": s for i, s in enumerate(WEBHOOK_SECRETS)},
                **{f"webhook secret {i} (key part)": s.removeprefix("whsec_") for i, s in enumerate(WEBHOOK_SECRETS)}}
    assert all(len(value) > 20 for value in secrets_.values())
    blob = json.dumps(job)
    listing = api.get("/v1/jobs", params={"limit": 100}).text
    logs = {path.name: path.read_text(errors="replace") for path in system.logs.glob("*.log")}
    assert {"api.log", "worker-ar.log", "worker-dit.log", "worker-results.log", "worker-webhooks.log"} <= set(logs)
    leaks = [f"{what} in {where}" for what, value in secrets_.items()
             for where, text in {"job JSON": blob, "job list": listing, **logs}.items() if value in text]
    assert leaks == []
