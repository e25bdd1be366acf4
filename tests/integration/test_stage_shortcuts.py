"""The stage runner's two shortcuts. It starts from the job its task message carried (no read first;
a stale copy changes nothing). With results inline, the worker whose stage ends a job begins its
final files while that stage's completion commits (omni_jobs.run.stage_outputs.EarlyOutputs). Real DiT engine,
real Redis, files on disk."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from PIL import Image

from omni_jobs.accept.submission import JobSubmitter
from omni_jobs.artifacts import ArtifactStore, ArtifactStoreUnavailable, LocalBackend, RedisBackend
from omni_jobs.jobs.ledger import JobLedger, Lease
from omni_jobs.jobs.models import Job, JobStatus, StageStatus
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import RunStage
from omni_jobs.pipelines.catalogue import PipelineCatalogue, parse_pipeline
from omni_jobs.report.results import ResultsAssembler
from omni_jobs.run.stage_reports import Reporting
from omni_jobs.run.stages import StageRunner
from tests.integration.test_stage_runner import SLOW_DIT
from tests.outbox import due_steps

PIPELINE = {**SLOW_DIT, "name": "inline-image", "stages": [
    {**SLOW_DIT["stages"][0], "defaults": {"height": 32, "width": 32, "num_inference_steps": 2, "seed": 0}}]}
"""One DiT stage, quick; its image is the job's one output."""

class RecordingDisk(LocalBackend):
    """Notes when each final file's write begins and ends."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.begun = threading.Event()
        self.started: list[str] = []
        self.ended: list[str] = []
        self.fail_next = 0

    def put(self, key: str, data: bytes, **kwargs: Any) -> None:
        if "/outputs/" in key:
            self.started.append(key)
            self.begun.set()
            if self.fail_next:
                self.fail_next -= 1
                raise ArtifactStoreUnavailable("local", "put", key, OSError(28, "No space left on device"))
        super().put(key, data, **kwargs)
        if "/outputs/" in key:
            self.ended.append(key)


class RecordingRedis(RedisBackend):
    """Notes every key read back."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(client)
        self.read: list[str] = []

    def get(self, key: str) -> bytes:
        self.read.append(key)
        return super().get(key)


class CompletionWatch(JobLedger):
    """The real ledger; its stage completion first waits (5 s at most) for a final file to have begun,
    and may cancel the job just before it writes (a cancel that lands while the stage finishes). It
    counts its reads of a job."""

    disk: RecordingDisk
    cancel_first = False
    waited: bool | None = None
    reads = 0

    def get(self, job_id: str) -> Job | None:
        self.reads += 1
        return super().get(job_id)

    def complete_stage(self, lease: Lease, *args: Any, **kwargs: Any) -> Job | Any:
        self.waited = self.disk.begun.wait(5)
        if self.cancel_first:
            self.cancel(lease.job_id)
        return super().complete_stage(lease, *args, **kwargs)


@pytest.fixture(scope="module")
def engines() -> Any:
    from omni_jobs.engines.pool import EnginePool
    from tests.conftest import MODELS_DIR

    return EnginePool(MODELS_DIR, kv_cache_bytes=64 * 2**20, max_model_len=256, device="cpu")


@pytest.fixture
def parts(redis_client: redis.Redis, tmp_path: Path, engines: Any) -> dict[str, Any]:
    catalogue = PipelineCatalogue([parse_pipeline(PIPELINE, source="test")])
    store = RedisJobStore(redis_client, ttl_s=600)
    ledger = CompletionWatch(store, lease_s=30.0)
    disk = ledger.disk = RecordingDisk(tmp_path)
    small = RecordingRedis(redis_client)
    artifacts = ArtifactStore(disk, small)
    results = ResultsAssembler(ledger=ledger, catalogue=catalogue, artifacts=artifacts)
    runner = StageRunner(ledger=ledger, catalogue=catalogue, artifacts=artifacts, engines=engines,
                         reporting=Reporting(progress_interval_s=0), assemble_results=results)
    return {"store": store, "ledger": ledger, "disk": disk, "small": small, "runner": runner,
            "submit": JobSubmitter(ledger, catalogue), "artifacts": artifacts}


def first_step(parts: dict[str, Any], job: Job) -> RunStage:
    (step,) = due_steps(parts["store"], job.id)
    assert isinstance(step, RunStage)
    return step


def test_the_last_stage_begins_the_final_files_before_its_completion_commits(parts: dict[str, Any]) -> None:
    ledger: CompletionWatch = parts["ledger"]
    job = parts["submit"].submit("inline-image", {"prompt": "a lighthouse"})
    outcome = parts["runner"].run(first_step(parts, job), worker="dit@h", owner="dit@h#1")
    read_in_run = list(parts["small"].read)
    assert outcome.status == "succeeded"
    assert ledger.waited is True, "no final file was begun before the stage's completion was written"
    done = ledger.require(job.id)
    assert done.status is JobStatus.succeeded and done.results.status is StageStatus.succeeded
    assert done.results.attempts == 1 and parts["store"].leased_slots() == []
    (image,) = done.outputs
    assert (image.name, image.width, image.height) == ("image", 32, 32)
    png = parts["artifacts"].get(image.artifact)
    assert png == parts["artifacts"].get(done.stage_record("dit").outputs["image"])  # the stage's own PNG
    assert Image.open(io.BytesIO(png)).size == (32, 32)
    assert parts["disk"].started == parts["disk"].ended == [f"jobs/{job.id}/outputs/image.png"]  # written once
    assert done.stage_record("dit").outputs["image"].key not in read_in_run, \
        "the final file was made from the stage's outputs read back from the store, not from its own bytes"
    # the stage's image is stored once: its recorded output is the job's file, no copy went to Redis
    assert done.stage_record("dit").outputs["image"] == image.artifact
    assert parts["artifacts"].delete_job_intermediates(job.id) == 0


def test_a_final_file_that_fails_leaves_the_results_step_to_write_it_from_the_stages_stored_copy(
        parts: dict[str, Any]) -> None:
    """The early write of the image fails: the stage's image is stored as an intermediate after all,
    the completion takes the results step (it cannot end the job), and that step writes the file again."""
    parts["disk"].fail_next = 1
    job = parts["submit"].submit("inline-image", {"prompt": "a full disk"})
    outcome = parts["runner"].run(first_step(parts, job), worker="dit@h", owner="dit@h#1")
    assert outcome.status == "succeeded"
    done = parts["ledger"].require(job.id)
    assert done.status is JobStatus.succeeded and done.results.attempts == 1
    (image,) = done.outputs
    stored = done.stage_record("dit").outputs["image"]
    assert stored != image.artifact and stored.backend == "redis"  # the stage's own copy, read back for the file
    assert parts["small"].read == [stored.key]
    assert parts["artifacts"].get(image.artifact) == parts["artifacts"].get(stored)
    # the results step writes under keys of its own (omni_jobs.report.results.writer_of); the failed write left nothing
    assert parts["disk"].started == [f"jobs/{job.id}/outputs/image.png", f"jobs/{job.id}/outputs/results-1/image.png"]
    assert image.artifact.key == f"jobs/{job.id}/outputs/results-1/image.png"


def test_files_begun_for_a_completion_that_is_refused_end_with_the_attempt(parts: dict[str, Any]) -> None:
    """Canceled while the stage finished: its completion is refused, the job keeps no outputs, and the
    files begun early have finished before the attempt returns (none outlives it)."""
    ledger: CompletionWatch = parts["ledger"]
    ledger.cancel_first = True
    job = parts["submit"].submit("inline-image", {"prompt": "a canceled lighthouse"})
    outcome = parts["runner"].run(first_step(parts, job), worker="dit@h", owner="dit@h#1")
    assert outcome.status == "discarded" and ledger.waited is True
    final = ledger.require(job.id)
    assert final.status is JobStatus.canceled and final.outputs == []
    assert parts["disk"].ended == parts["disk"].started  # begun early, ended before run() returned
    assert parts["store"].leased_slots() == []


def test_a_stage_starts_from_the_job_its_message_carried(parts: dict[str, Any]) -> None:
    ledger: CompletionWatch = parts["ledger"]
    job = parts["submit"].submit("inline-image", {"prompt": "a harbour"})
    step = first_step(parts, job)
    carried = ledger.require(job.id)  # what the store's script puts in the message (test_direct_publish)
    ledger.reads = 0
    assert parts["runner"].run(step, worker="dit@h", owner="dit@h#1", snapshot=carried).status == "succeeded"
    assert ledger.reads == 0, "the job was read although the message carried it"
    done = ledger.require(job.id)
    assert done.status is JobStatus.succeeded and done.stage_record("dit").attempts == 1


def test_a_stale_carried_job_changes_nothing(parts: dict[str, Any]) -> None:
    """Canceled after its message went out: the start is refused (the guarded write sees it). Carried
    from before its stage was queued (an older copy than the message): checked against the stored
    job, the stage starts."""
    ledger: CompletionWatch = parts["ledger"]
    job = parts["submit"].submit("inline-image", {"prompt": "a canceled harbour"})
    step = first_step(parts, job)
    carried = ledger.require(job.id)
    ledger.cancel(job.id)
    outcome = parts["runner"].run(step, worker="dit@h", owner="dit@h#1", snapshot=carried)
    assert outcome.status == "skipped" and ledger.require(job.id).status is JobStatus.canceled
    assert parts["disk"].started == []

    job = parts["submit"].submit("inline-image", {"prompt": "an old copy"})
    step = first_step(parts, job)
    older = ledger.require(job.id).clone()
    older.stage_record("dit").status = StageStatus.pending
    outcome = parts["runner"].run(step, worker="dit@h", owner="dit@h#1", snapshot=older)
    assert outcome.status == "succeeded" and ledger.require(job.id).status is JobStatus.succeeded
