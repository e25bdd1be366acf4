"""A stale attempt of a job's last stage cannot change the files of the job that succeeded (issue 62).

Attempt 1 of the last stage lost its lease (its worker stalled past it) and attempt 2 ran, wrote the
job's files and ended it succeeded. Attempt 1 then finished too and began the job's files from its own
bytes, as results inline does before its (refused) commit: under the same keys, so the succeeded
job's file was replaced, its recorded sha256 no longer matched and its download answered 500. Now
each writer writes under keys of its own, and the job's record names the files of the attempt that
was recorded; a download never answers 500, even for a file changed behind the system's back.

Real Redis, a local artifact directory, the real app; the stage attempts driven through the ledger.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from omni_jobs.accept.auth import ApiKeys
from omni_jobs.artifacts import ArtifactStore, LocalBackend, RedisBackend
from omni_jobs.core import keys
from omni_jobs.core.settings import Settings
from omni_jobs.jobs.ledger import Acquired, JobLedger
from omni_jobs.jobs.models import JobStatus
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import AssembleResults, RunStage
from omni_jobs.media.payloads import encode_payload
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.report.results import ResultsAssembler

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, artifacts_dir=tmp_path / "artifacts", models_dir=tmp_path / "models",
                    output_urls="api")


@pytest.fixture
def api(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        yield client


def take(ledger: JobLedger, step: RunStage | AssembleResults, owner: str) -> Acquired:
    taken = ledger.acquire(step, worker=owner.split("#")[0], owner=owner)
    assert isinstance(taken, Acquired), taken
    return taken


def test_a_stale_last_stage_attempt_leaves_the_succeeded_jobs_files_alone(
        api: TestClient, settings: Settings, redis_client: redis.Redis) -> None:
    key = {"authorization": f"Bearer {ApiKeys(redis_client).create('acme')[0]}"}
    job_id = api.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "x"}}, headers=key).json()["id"]
    store = RedisJobStore(redis_client, ttl_s=3600)
    ledger = JobLedger(store, lease_s=3600)
    artifacts = ArtifactStore(LocalBackend(settings.artifacts_dir), RedisBackend(redis_client), small_max_bytes=0)
    assembler = ResultsAssembler(ledger=ledger, catalogue=load_catalogue(), artifacts=artifacts)

    stale = take(ledger, RunStage(job_id, "ar", 1, "ar"), "ar@a#1.aa")
    assert ledger.expire(f"stage:{job_id}:ar", dead_owner=lambda owner: owner == "ar@a#1.aa") == "requeued"
    fresh = take(ledger, RunStage(job_id, "ar", 2, "ar"), "ar@b#2.bb")
    text = artifacts.put_intermediate(keys.intermediate_artifact(job_id, "ar", "text.json", 2),
                                      encode_payload("text", "the recorded answer"), "application/json")
    ledger.complete_stage(fresh.lease, {"text": text}, {})
    results = take(ledger, AssembleResults(job_id, 1), "results@c#3.cc")
    assert assembler.run_held(results.job, results.lease).status == "succeeded"
    done = api.get(f"/v1/jobs/{job_id}", headers=key).json()
    assert done["status"] == JobStatus.succeeded.value
    before = api.get(f"/v1/jobs/{job_id}/outputs/text", headers=key)
    assert before.status_code == 200 and before.json() == {"text": "the recorded answer"}

    # Attempt 1 comes back: results inline begins the job's files from its own bytes before its commit.
    late = assembler.start_outputs(stale.job, {("ar", "text"): encode_payload("text", "a stale answer")})
    assert [f.result().name for f in late] == ["text"]
    assert ledger.complete_stage(stale.lease, {}, {}).__class__.__name__ == "Refused"  # its commit is refused

    after = api.get(f"/v1/jobs/{job_id}/outputs/text", headers=key)
    assert after.status_code == 200, after.text
    assert after.json() == {"text": "the recorded answer"}
    assert after.headers["content-disposition"] == 'inline; filename="text.json"'


def test_a_download_whose_file_was_changed_is_not_a_500(api: TestClient, settings: Settings,
                                                        redis_client: redis.Redis) -> None:
    secret = ApiKeys(redis_client).create("acme")[0]
    key = {"authorization": f"Bearer {secret}"}
    job_id = api.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "x"}}, headers=key).json()["id"]
    ledger = JobLedger(RedisJobStore(redis_client, ttl_s=3600), lease_s=3600)
    artifacts = ArtifactStore(LocalBackend(settings.artifacts_dir), RedisBackend(redis_client), small_max_bytes=0)
    ran = take(ledger, RunStage(job_id, "ar", 1, "ar"), "ar@a#1.aa")
    text = artifacts.put_intermediate(keys.intermediate_artifact(job_id, "ar", "text.json", 1),
                                      encode_payload("text", "recorded"), "application/json")
    ledger.complete_stage(ran.lease, {"text": text}, {})
    results = take(ledger, AssembleResults(job_id, 1), "results@c#3.cc")
    ResultsAssembler(ledger=ledger, catalogue=load_catalogue(), artifacts=artifacts).run_held(results.job,
                                                                                             results.lease)
    (output,) = ledger.require(job_id).outputs
    (settings.artifacts_dir / output.artifact.key).write_bytes(b'{"text": "changed by hand"}')  # not by the system
    response = api.get(f"/v1/jobs/{job_id}/outputs/text", headers=key)
    assert response.status_code == 502, response.text
    assert "does not match" in response.json()["detail"]
    token = re.search(r'name="csrf_token" value="([^"]+)"', api.get("/ui/login").text)
    assert token
    assert api.post("/ui/login", data={"api_key": secret, "csrf_token": token.group(1)},
                    follow_redirects=False).status_code == 303
    console = api.get(f"/ui/jobs/{job_id}/outputs/text")  # the console's own file route
    assert console.status_code == 502 and "do not match" in console.text
