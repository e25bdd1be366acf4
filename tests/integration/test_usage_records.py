"""Usage kept in Redis (omni_jobs.report.usage.UsageRecorder, read_usage): commits add to a tally that a flush writes,
read back per tenant and day. Real Redis."""

from __future__ import annotations

import pytest
import redis

from omni_jobs.accept.submission import build_job
from omni_jobs.jobs.models import EventType, JobEvent
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.report.usage import DAY_S, UsageRecorder, read_usage

pytestmark = pytest.mark.integration
DAY = 1577836800.0  # 2020-01-01T00:00:00Z: no job of the session's other tests is counted that day


def test_commits_are_tallied_then_written_and_read_per_tenant_and_day(redis_client: redis.Redis) -> None:
    recorder = UsageRecorder(redis_client, flush_s=3600)  # no flush by time in this test
    for tenant, at in (("acme", DAY + 5), ("acme", DAY + 6), ("beta", DAY + DAY_S + 1)):
        job = build_job(load_catalogue().get("text-to-text"), {"prompt": "x"}, {})
        job.tenant = tenant
        recorder.job_events(job, [JobEvent(job_id=job.id, type=EventType.job_queued, at=at)])
    assert read_usage(redis_client, tenants=None, start=DAY, end=DAY + 2 * DAY_S)["data"] == [
        {"object": "bucket", "start_time": int(DAY), "end_time": int(DAY + DAY_S), "results": []},
        {"object": "bucket", "start_time": int(DAY + DAY_S), "end_time": int(DAY + 2 * DAY_S), "results": []}]
    assert recorder.flush() == 2  # (acme, day 1, queued) and (beta, day 2, queued)
    page = read_usage(redis_client, tenants=None, start=DAY, end=DAY + 2 * DAY_S)
    first, second = page["data"]
    assert [(r["tenant"], r["jobs"]) for r in first["results"]] == [("acme", {"queued": 2})]
    assert [(r["tenant"], r["jobs"]) for r in second["results"]] == [("beta", {"queued": 1})]
    only_acme = read_usage(redis_client, tenants=["acme"], start=DAY + DAY_S, end=DAY + 2 * DAY_S)
    assert only_acme["data"][0]["results"] == []
    assert recorder.flush() == 0
    with pytest.raises(ValueError):
        read_usage(redis_client, tenants=None, start=DAY, end=DAY)
