"""The JobStore contract: every test here runs against both stores, in memory and in real Redis.

The ledger makes every decision and the stores only apply Changes, so one suite shows that both
apply them with the same semantics (guards, ops, outbox, indexes, events).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.store import JobStore


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.integration)])
def store(request: pytest.FixtureRequest) -> Iterator[JobStore]:
    if request.param == "memory":
        yield MemoryJobStore(ttl_s=3600)
    else:
        yield RedisJobStore(request.getfixturevalue("redis_client"), ttl_s=3600)


@pytest.fixture
def ledger(store: JobStore) -> JobLedger:
    return JobLedger(store, lease_s=30.0, max_attempts=3, webhook_progress_interval_s=0.0)
