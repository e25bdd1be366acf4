"""Presigned output URLs name the endpoint clients reach (signing needs no network)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from omni_jobs.artifacts import ArtifactRef, artifact_store_from_settings
from omni_jobs.core.settings import Settings
from omni_jobs.jobs.models import Job, JobOutput
from omni_jobs.jobs.view import present_job

REF = ArtifactRef(backend="s3", key="jobs/job_1/outputs/image.png", media_type="image/png", size=3, sha256="0" * 64)


def s3_settings(**extra: object) -> Settings:
    return Settings(artifact_backend="s3", s3_endpoint_url="http://minio:9000", s3_access_key_id="k",
                    s3_secret_access_key="s", s3_bucket="b", **extra)


def job_with_output() -> Job:
    out = JobOutput(name="image", type="image", media_type="image/png", size=3, artifact=REF, width=1, height=1)
    return Job(id="job_1", pipeline="text-to-image", input={"prompt": "x"}, stages=[], outputs=[out])


def test_presigned_url_uses_the_public_endpoint_when_set() -> None:
    inside = artifact_store_from_settings(s3_settings()).url(REF, filename="image.png")
    outside = artifact_store_from_settings(s3_settings(s3_public_endpoint_url="https://files.example.com")).url(REF)
    assert inside is not None and urlparse(inside).netloc == "minio:9000"
    assert outside is not None and urlparse(outside).netloc == "files.example.com"
    assert urlparse(outside).path == "/b/jobs/job_1/outputs/image.png" and "X-Amz-Signature=" in outside


def test_output_urls_setting_chooses_api_route(tmp_path: Path) -> None:
    store = artifact_store_from_settings(s3_settings())
    job = job_with_output()
    presigned = present_job(job, public_url="http://api:8000", artifacts=store)["outputs"][0]["url"]
    via_api = present_job(job, public_url="http://api:8000", artifacts=store, presign=False)["outputs"][0]["url"]
    assert "X-Amz-Signature=" in presigned
    assert via_api == "http://api:8000/v1/jobs/job_1/outputs/image"
    local = artifact_store_from_settings(Settings(artifacts_dir=tmp_path))
    local_ref = REF.model_copy(update={"backend": "local"})
    job.outputs[0] = job.outputs[0].model_copy(update={"artifact": local_ref})
    assert present_job(job, public_url="http://api:8000", artifacts=local)["outputs"][0]["url"] == via_api
