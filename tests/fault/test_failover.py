"""Redis failover under Sentinels: SIGKILL the primary with jobs in flight (tests/fault/failover.py).

The whole run (240 jobs, the primary killed once 200 got 202; marker ``chaos``):

    scripts/test -m chaos tests/fault/test_failover.py -s

A small one (40 jobs, killed at 20) is in the default run. Both with OMNI_REDIS_WAIT_REPLICAS=1:
nothing answered 202 is lost, nothing runs or is delivered twice, and every job is done within 60 s
of the failover.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fault import chaos, failover


@pytest.fixture(autouse=True)
def everything_running() -> Iterator[None]:
    """This run starts a system of its own: not the shared fault system (tests/fault/conftest.py)."""
    yield


def _assert_nothing_lost(result: failover.FailoverResult, jobs: int) -> None:
    print("\n" + result.table())
    assert len(result.accepted) == jobs
    assert result.missing == [], result.table()
    assert result.succeeded == len(result.accepted), result.table()
    assert (result.duplicate_runs, result.duplicate_webhooks, result.missing_webhooks,
            result.duplicate_files) == (0, 0, 0, 0), result.table()
    assert result.last_done_after_last_fault_s <= chaos.DONE_WITHIN_S, result.table()


@pytest.mark.chaos
def test_failover_with_200_jobs_in_flight_loses_nothing(tmp_path: Path) -> None:
    result = failover.run(jobs=240, kill_at=200, wait_replicas=1, home=tmp_path / "failover")
    _assert_nothing_lost(result, 240)
    assert result.in_flight_at_kill >= 200, result.table()


def test_failover_small(tmp_path: Path) -> None:
    result = failover.run(jobs=40, kill_at=20, wait_replicas=1, home=tmp_path / "failover")
    _assert_nothing_lost(result, 40)
    assert result.in_flight_at_kill >= 15, result.table()
