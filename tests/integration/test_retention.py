"""Retention on a real Redis and a real directory store: what expires goes, what does not stays."""

from __future__ import annotations

from pathlib import Path

import redis

from omni_jobs import keys
from omni_jobs.artifacts import ArtifactStore, LocalBackend, RedisBackend
from omni_jobs.jobs import state
from omni_jobs.jobs.models import JobEvent, JobStatus
from omni_jobs.jobs.store import JobStore
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.retention import cleanup
from omni_jobs.submission import build_job, resolve_params

T2T = load_catalogue().get("text-to-text")
DAY = 24 * 3600.0
NOW = 1_000_000_000.0


def stored_job(store: JobStore, artifacts: ArtifactStore, created_at: float, *, finished: bool = True,
               deadline_at: float | None = None) -> str:
    job = build_job(T2T, {"prompt": "x"}, resolve_params(T2T, {}))
    job.created_at = created_at
    job.deadline_at = deadline_at
    if finished:
        state.stage_queued(job, "ar", created_at)
        state.stage_started(job, "ar", "w", created_at)
        state.stage_succeeded(job, "ar", {}, {}, created_at + 1)
        state.job_succeeded(job, created_at + 2)
    store.create(job, [JobEvent(job_id=job.id, type="job.queued")])
    artifacts.put_output(keys.output_artifact(job.id, "text.json"), b'{"text":"x"}', "application/json")
    big = b"x" * 4096  # over the Redis threshold: lands in the directory, which has no TTL
    artifacts.put_intermediate(keys.intermediate_artifact(job.id, "ar", "text.json"), big, "application/json")
    return job.id


def test_cleanup_removes_expired_jobs_and_intermediates_and_cancels_overdue(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = JobStore(redis_client, ttl_s=int(30 * DAY))
    artifacts = ArtifactStore(LocalBackend(tmp_path), RedisBackend(redis_client), small_max_bytes=1024)
    ancient = stored_job(store, artifacts, NOW - 8 * DAY)  # past the 7-day output TTL
    old = stored_job(store, artifacts, NOW - 2 * DAY)  # past the 1-day intermediate TTL only
    old_running = stored_job(store, artifacts, NOW - 2 * DAY, finished=False)
    fresh = stored_job(store, artifacts, NOW - 60)
    overdue = stored_job(store, artifacts, NOW - 120, finished=False, deadline_at=NOW - 1)

    report = cleanup(store, artifacts, output_ttl_s=7 * DAY, intermediate_ttl_s=DAY, max_deadline_s=7 * DAY, at=NOW)

    assert report.jobs_expired == 1 and report.artifacts_deleted == 2
    assert store.get(ancient) is None and not list(tmp_path.glob(f"jobs/{ancient}/**/*.json"))
    assert redis_client.zscore(keys.JOBS_INDEX, ancient) is None
    assert report.intermediates_deleted == 1
    assert not (tmp_path / "jobs" / old / "stages").exists() and (tmp_path / "jobs" / old / "outputs").exists()
    assert (tmp_path / "jobs" / old_running / "stages").exists()  # not finished: kept
    assert (tmp_path / "jobs" / fresh / "stages").exists()
    assert report.deadlines_canceled == 1
    job = store.require(overdue)
    assert job.status is JobStatus.canceled
    assert store.events(overdue)[-1].data["reason"] == "deadline exceeded (cancel_after)"

    again = cleanup(store, artifacts, output_ttl_s=7 * DAY, intermediate_ttl_s=DAY, max_deadline_s=7 * DAY, at=NOW)
    assert (again.jobs_expired, again.intermediates_deleted, again.deadlines_canceled) == (0, 0, 0)
    # The running job is revisited once it finishes.
    store.update(old_running, lambda j: state.job_canceled(j, NOW))
    later = cleanup(store, artifacts, output_ttl_s=7 * DAY, intermediate_ttl_s=DAY, max_deadline_s=7 * DAY,
                    at=NOW + 10)
    assert later.intermediates_deleted == 1 and not (tmp_path / "jobs" / old_running / "stages").exists()
