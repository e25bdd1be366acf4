"""A Redis outage longer than the lease must not take running steps from the workers that run them
(issue 62). While Redis is away nobody renews: every lease runs out. Once it is back, the reaper (in
every worker, every couple of seconds) requeued those steps before their keepers (every third of the
lease) renewed them, so live workers lost their work and ran it again. Real processes: a Redis server
SIGKILLed and restarted from its AOF, a worker holding a step's lease, and another worker's reaper."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import Job, StageRecord, StageStatus, new_job_id
from omni_jobs.jobs.store import RedisJobStore
from omni_jobs.local.devservices import RunningService, start_redis

pytestmark = pytest.mark.fault  # (not in tests/fault: it needs none of that suite's system)

REPO = Path(__file__).resolve().parents[2]
LEASE_S = 3.0
OUTAGE_S = 2 * LEASE_S + 1


@pytest.fixture
def state(tmp_path: Path) -> Iterator[RunningService]:
    with start_redis(data_dir=tmp_path / "state", appendonly=True, appendfsync="always") as service:
        yield service


def actor(*args: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "tests.fault.lease_actors", *args], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)


def wait_for(log: Path, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def test_an_outage_longer_than_the_lease_leaves_running_steps_to_their_live_workers(
        state: RunningService, tmp_path: Path) -> None:
    client = redis.Redis.from_url(state.url)
    ledger = JobLedger(RedisJobStore(client, ttl_s=3600), lease_s=LEASE_S)
    job, _ = ledger.submit(Job(id=new_job_id(), pipeline="p", input={},
                               stages=[StageRecord(id="s", engine="ar", queue="s")]), ["s"])
    holder = actor("hold", state.url, job.id, str(LEASE_S), log=tmp_path / "holder.log")
    other = actor("reap", state.url, str(LEASE_S), log=tmp_path / "other.log")
    try:
        wait_for(tmp_path / "holder.log", "held")
        wait_for(tmp_path / "other.log", "reaping")
        time.sleep(LEASE_S)  # renewed a few times: the lease holds while Redis is up
        assert ledger.require(job.id).stage_record("s").status is StageStatus.running
        state.kill()  # SIGKILL: nobody can renew, every lease runs out meanwhile
        time.sleep(OUTAGE_S)
        state.start()  # back from its AOF, the leases long expired
        time.sleep(3 * LEASE_S)  # the reapers' passes and the keepers' renewals, in whatever order they come
        record = ledger.require(job.id).stage_record("s")
        assert (record.status, record.attempts) == (StageStatus.running, 1), \
            f"a live worker's step was taken back: {record.status} attempt {record.attempts}"
        assert holder.poll() is None and "lost" not in (tmp_path / "holder.log").read_text()
        # A worker that is really gone still loses its step, once the store has been back a while.
        holder.kill()
        holder.wait(timeout=30)
        deadline = time.monotonic() + 6 * LEASE_S
        while ledger.require(job.id).stage_record("s").status is StageStatus.running:
            assert time.monotonic() < deadline, "a dead worker's step was never taken back"
            time.sleep(0.1)
        assert ledger.require(job.id).stage_record("s").status is StageStatus.queued
    finally:
        for process in (holder, other):
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
        client.close()
