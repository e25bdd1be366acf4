"""The batch driver's passes against real Redis, with the job ledger in memory (no workers): lines
become low-priority jobs within the in-flight cap, a pass run twice makes no second job, the end of
the completion window cancels what runs and writes every line once, and cancelling accounts for the
lines never submitted."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from omni_jobs.accept.batch_lines import LinePlanner
from omni_jobs.accept.batch_results import Shaping
from omni_jobs.accept.batches import Batches
from omni_jobs.accept.files import FileStore
from omni_jobs.accept.submission import JobSubmitter
from omni_jobs.artifacts.store import artifact_store_from_settings
from omni_jobs.core import keys
from omni_jobs.core.settings import OPENAI_MODEL_NAMES, Settings
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.models import JobStatus
from omni_jobs.local.devservices import RunningService
from omni_jobs.pipelines.catalogue import load_catalogue

pytestmark = pytest.mark.integration
TENANT = "acme"


@pytest.fixture
def world(redis_service: RunningService, tmp_path: Path) -> Iterator[tuple[Batches, JobLedger, redis.Redis]]:
    client = redis.Redis.from_url(redis_service.url)
    settings = Settings(artifacts_dir=tmp_path / "artifacts", redis_url=redis_service.url)
    artifacts = artifact_store_from_settings(settings)
    catalogue = load_catalogue()
    ledger = JobLedger(MemoryJobStore())
    submitter = JobSubmitter(ledger, catalogue)
    shaping = Shaping(read=artifacts.get, present=lambda job: {"id": job.id, "status": job.status.value},
                      url_of=lambda job, name: name, output_ttl_s=60)
    batches = Batches(client, files=FileStore(client, artifacts, ttl_s=3600),
                      planner=LinePlanner(catalogue, submitter, OPENAI_MODEL_NAMES, max_outputs=4),
                      submitter=submitter, get_jobs=ledger.store.get_many, cancel_job=ledger.cancel, shaping=shaping,
                      max_in_flight=3, max_lines=100)
    try:
        yield batches, ledger, client
    finally:
        client.flushdb()
        client.close()


def make_batch(batches: Batches, n: int) -> str:
    rows = [{"custom_id": f"c{i}", "url": "/v1/jobs",
             "body": {"pipeline": "text-to-text", "input": {"prompt": f"p{i}"}}} for i in range(n)]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    summary = batches.check_file(data)
    record = batches.files.put(TENANT, data, filename="in.jsonl", purpose="batch", lines=summary.lines)
    batch = batches.create(TENANT, input_file_id=record.id, endpoint="/v1/jobs", completion_window="24h")
    return str(batch["id"])


def lines_of(batches: Batches, file_id: object) -> list[dict[str, object]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in batches.files.content(TENANT, str(file_id)).splitlines()]


def test_lines_become_low_priority_jobs_within_the_cap_and_once(
        world: tuple[Batches, JobLedger, redis.Redis]) -> None:
    batches, ledger, client = world
    batch_id = make_batch(batches, 5)
    batches.advance(batch_id)
    batches.advance(batch_id)  # a second pass (or a rerun after a crash) submits nothing more: the cap is full
    assert batches.get(TENANT, batch_id)["status"] == "in_progress"
    recorded = {k.decode(): v.decode() for k, v in client.hgetall(keys.batch_lines(batch_id)).items()}
    assert sorted(recorded) == ["0", "1", "2"]  # max_in_flight 3
    jobs = [ledger.get(job_id) for job_id in recorded.values()]
    assert all(job is not None and job.priority.value == "low" and job.tenant == TENANT for job in jobs)
    client.hset(keys.batch(batch_id), "cursor", "0")  # as if the cursor's write was lost: lines are submitted again
    client.delete(keys.batch_lines(batch_id))
    client.delete(keys.batch_pending(batch_id))
    batches.advance(batch_id)
    again = {k.decode(): v.decode() for k, v in client.hgetall(keys.batch_lines(batch_id)).items()}
    assert again == recorded  # the Idempotency-Key batch:<id>:<line> answered the same jobs


def test_the_end_of_the_window_cancels_and_writes_every_line_once(
        world: tuple[Batches, JobLedger, redis.Redis]) -> None:
    batches, ledger, client = world
    batch_id = make_batch(batches, 5)
    batches.advance(batch_id)
    client.hset(keys.batch(batch_id), "expires_at", "1")
    batches.advance(batch_id)  # cancels the running jobs
    batches.advance(batch_id)  # they ended: finalize
    batch = batches.get(TENANT, batch_id)
    assert batch["status"] == "expired" and batch["expired_at"]
    errors = lines_of(batches, batch["error_file_id"])
    assert [e["custom_id"] for e in errors] == [f"c{i}" for i in range(5)]
    assert batch["output_file_id"] is None
    assert batch["request_counts"] == {"total": 5, "completed": 0, "failed": 5}
    codes = [(e["error"] or {}).get("code") or e["response"]["body"]["error"]["code"] for e in errors]  # type: ignore[index, union-attr]
    assert codes == ["job_canceled"] * 3 + ["batch_expired"] * 2
    job_ids = [e["response"]["request_id"] for e in errors[:3]]  # type: ignore[index]
    assert all(ledger.get(str(j)).status is JobStatus.canceled for j in job_ids)  # type: ignore[union-attr]
    assert not client.zscore(keys.BATCHES_ACTIVE, batch_id)


def test_a_cancel_accounts_for_lines_never_submitted(world: tuple[Batches, JobLedger, redis.Redis]) -> None:
    batches, _ledger, _client = world
    batch_id = make_batch(batches, 4)
    assert batches.cancel(TENANT, batch_id)["status"] == "cancelling"
    batches.advance(batch_id)
    batch = batches.get(TENANT, batch_id)
    assert batch["status"] == "cancelled"
    errors = lines_of(batches, batch["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"c{i}", "batch_cancelled") for i in range(4)]  # type: ignore[index]
    assert batches.cancel(TENANT, batch_id)["status"] == "cancelled"
    with pytest.raises(Exception) as other_tenant:
        batches.get("someone-else", batch_id)
    assert getattr(other_tenant.value, "status", None) == 404


def test_an_ended_batch_is_kept_as_long_as_its_files(world: tuple[Batches, JobLedger, redis.Redis]) -> None:
    batches, _ledger, client = world
    batch_id = make_batch(batches, 2)
    batches.cancel(TENANT, batch_id)
    batches.advance(batch_id)
    assert 0 < client.ttl(keys.batch(batch_id)) <= 3600
    assert client.ttl(keys.batch_lines(batch_id)) in (-2, *range(1, 3601))  # none recorded: no key at all
    assert not client.exists(keys.batch_pending(batch_id))


def test_a_files_bytes_go_when_its_time_runs_out(world: tuple[Batches, JobLedger, redis.Redis]) -> None:
    batches, _ledger, client = world
    record = batches.files.put(TENANT, b'{"x": 1}\n', filename="f.jsonl", purpose="batch", lines=1)
    assert batches.files.sweep(time.time()) == 0  # not due: kept
    assert batches.files.content(TENANT, record.id) == b'{"x": 1}\n'
    assert batches.files.sweep(time.time() + 3601) == 1  # the fixture's files live an hour
    assert not batches.files.artifacts.exists(record.artifact)
    assert not client.exists(keys.file(record.id)) and client.zcard(keys.FILES_EXPIRING) == 0
    gone = batches.files.put(TENANT, b"{}\n", filename="g.jsonl", purpose="batch", lines=1)
    batches.files.delete(TENANT, gone.id)  # a deleted file leaves nothing to sweep
    assert client.zcard(keys.FILES_EXPIRING) == 0
