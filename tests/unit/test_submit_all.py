"""Several jobs in one write (JobLedger.submit_all, JobSubmitter.submit_all): all of them or none, so that
the OpenAI images route's n jobs are never half made by a quota (issue 62)."""

from __future__ import annotations

import time

import pytest

from omni_jobs.accept.submission import JobSubmitter
from omni_jobs.core.errors import InvalidRequest, QuotaExceeded
from omni_jobs.jobs.ledger import JobLedger, Quota
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.pipelines.catalogue import load_catalogue


def created(store: MemoryJobStore) -> list[str]:
    return store.job_ids_created(after=None, until=time.time() + 60)


def test_a_quota_that_holds_some_refuses_them_all() -> None:
    store = MemoryJobStore()
    submitter = JobSubmitter(JobLedger(store), load_catalogue())
    quota = Quota(max_active=3)
    first = submitter.submit_all("text-to-text", {"prompt": "x"}, [{}, {}])
    assert len(first) == 2 and len(created(store)) == 2
    with pytest.raises(QuotaExceeded) as refused:
        submitter.ledger.submit_all([(n.job, n.entry_stages, None) for n in (
            submitter._accept("text-to-text", {"prompt": "x"}, {}, cancel_after_s=None, idempotency_key=None,
                              webhook=None, webhook_events_filter=None, tenant="default", priority=None)
            for _ in range(2))], quota=quota)
    assert refused.value.limit == "max_active"
    assert len(created(store)) == 2  # neither of the two was made
    with pytest.raises(InvalidRequest) as never:  # more than the quota holds at all: not a 429 to retry for ever
        JobSubmitter._fits(4, quota)
    assert never.value.errors[0].loc == ("n",)


def test_keys_used_before_answer_their_jobs_and_the_rest_are_made_together() -> None:
    store = MemoryJobStore()
    submitter = JobSubmitter(JobLedger(store), load_catalogue())
    (one,) = submitter.submit_all("text-to-text", {"prompt": "x"}, [{}], idempotency_keys=["k:0"])
    again = submitter.submit_all("text-to-text", {"prompt": "x"}, [{}, {}], idempotency_keys=["k:0", "k:1"])
    assert again[0].id == one.id and again[1].id != one.id
    assert [j.id for j in submitter.submit_all("text-to-text", {"prompt": "x"}, [{}, {}],
                                               idempotency_keys=["k:0", "k:1"])] == [j.id for j in again]
    assert len(created(store)) == 2
