"""The API's submit runs on the event loop: nothing in it may block that loop for long."""

from __future__ import annotations

import asyncio
import time

from omni_jobs.accept.submission import JobSubmitter
from omni_jobs.core.net_guard import NetGuard
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.pipelines.catalogue import load_catalogue
from tests.own_loop import run_in_own_loop

SLOW_DNS_S = 0.6


def slow_resolver(host: str, port: int) -> list[str]:
    time.sleep(SLOW_DNS_S)  # the OS resolver on a bad day
    return ["93.184.216.34"]


def test_a_slow_webhook_host_lookup_does_not_stall_other_requests() -> None:
    store = MemoryJobStore(ttl_s=3600)
    submitter = JobSubmitter(JobLedger(store), load_catalogue(), net_guard=NetGuard(resolve=slow_resolver))

    async def main() -> tuple[float, float, str | None]:
        longest_gap = 0.0

        async def ticker(stop: asyncio.Event) -> None:
            nonlocal longest_gap
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                longest_gap, last = max(longest_gap, now - last), now

        stop = asyncio.Event()
        ticking = asyncio.create_task(ticker(stop))
        started = time.monotonic()
        with_hook = asyncio.create_task(submitter.asubmit_idempotent(
            "text-to-text", {"prompt": "hi"}, webhook="https://hooks.example.com/done"))
        await asyncio.sleep(0.05)
        plain = await submitter.asubmit_idempotent("text-to-text", {"prompt": "no webhook"})
        plain_s = time.monotonic() - started
        done = await with_hook
        stop.set()
        await ticking
        assert plain.created
        return longest_gap, plain_s, done.job.webhook.url if done.job.webhook else None

    longest_gap, plain_s, hook_url = run_in_own_loop(main())
    assert hook_url == "https://hooks.example.com/done"
    assert plain_s < SLOW_DNS_S / 2, f"a submit without a webhook waited {plain_s:.2f}s behind the lookup"
    assert longest_gap < SLOW_DNS_S / 2, f"the event loop stalled {longest_gap:.2f}s"
