"""The typed Python client, sync and async, against the running test system."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from omni_jobs.client import (
    AsyncClient,
    Client,
    ConflictError,
    InvalidRequestError,
    JobEventView,
    JobView,
    NotFoundError,
    RateLimitedError,
    UnauthorizedError,
)
from omni_jobs.jobs.models import JobStatus
from omni_jobs.local.embedded import EmbeddedSystem

ROOT = Path(__file__).resolve().parents[2]

PARAMS = {"ar": {"max_tokens": 6}, "dit": {"height": 32, "width": 40, "num_inference_steps": 3, "seed": 4}}


def check_outputs(paths: dict[str, Path], job: JobView) -> None:
    assert set(paths) == {"image", "text"}
    with Image.open(paths["image"]) as image:
        assert image.size == (40, 32)
    assert paths["image"].stat().st_size == job.output("image").size  # type: ignore[union-attr]


def test_sync_client_covers_every_endpoint(system: EmbeddedSystem, tmp_path: Path) -> None:
    with Client(system.api_url, api_key=system.api_key) as omni:
        assert {p["name"] for p in omni.pipelines()} >= {"text-to-image", "text-to-text"}
        job = omni.submit("text-to-image", prompt="a client test", params=PARAMS, wait=30)
        assert isinstance(job, JobView) and job.status is JobStatus.succeeded and job.is_final
        assert job.queue_position is None and job.tenant == system.demo_tenant and job.metrics.total_time_s
        assert [s.id for s in job.stages] == ["ar", "dit"] and all(s.duration_s for s in job.stages)
        assert omni.get(job.id).id == job.id

        events = list(omni.events(job.id))  # a finished job: its whole history, then the end
        assert events[0].type == "job.queued" and events[-1].type == "job.succeeded"
        assert events[-1].job is not None and events[-1].job.status == "succeeded"
        resumed = list(omni.events(job.id, last_event_id=events[-3].id))
        assert [e.id for e in resumed] == [e.id for e in events[-2:]]

        check_outputs(omni.download_outputs(job, tmp_path), job)
        assert job.id in [j.id for j in omni.list(limit=50).data]
        assert any(j.id == job.id for j in omni.iter_jobs(status="succeeded", page_size=2))

        with pytest.raises(ConflictError, match="already succeeded"):
            omni.cancel(job.id)
        with pytest.raises(NotFoundError):
            omni.get("job_missing")
        with pytest.raises(InvalidRequestError) as bad:
            omni.submit("text-to-image", {"prompt": 7}, webhook="ftp://x")
        assert set(bad.value.fields) == {"body.input.prompt", "body.webhook"}

        queued = omni.submit("text-to-text", prompt="follow me", params={"ar": {"max_tokens": 4}})
        streamed = [e.type for e in omni.events(queued.id)]
        assert streamed[0] == "job.queued" and streamed[-1] == "job.succeeded"
        assert omni.wait(queued.id, timeout=30).status == "succeeded"


def test_async_client(system: EmbeddedSystem, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with AsyncClient(system.api_url, api_key=system.api_key) as omni:
            jobs = await asyncio.gather(*(omni.submit("text-to-image", prompt=f"async {i}", params=PARAMS)
                                          for i in range(2)))
            async def follow(job_id: str) -> list[JobEventView]:
                return [e async for e in omni.events(job_id)]

            streams = await asyncio.gather(*(follow(j.id) for j in jobs))  # two streams at once
            for events in streams:
                assert events[-1].type == "job.succeeded" and events[-1].job is not None
                dit = [e.data["step"] for e in events if e.type == "stage.progress" and e.data["stage"] == "dit"]
                assert dit and dit[-1] == 3
            done = await omni.wait(jobs[0].id, timeout=30)
            assert done.status == "succeeded"
            check_outputs(await omni.download_outputs(done, tmp_path), done)
            newest: list[str] = []
            async for j in omni.iter_jobs(page_size=1):  # one job per page: the cursor is followed
                newest.append(j.id)
                if len(newest) == 2:
                    break
            assert set(newest) == {j.id for j in jobs}
            listed = await omni.list(limit=10)
            assert {j.id for j in jobs} <= {j.id for j in listed.data}
            with pytest.raises(NotFoundError):
                await omni.cancel("job_missing")
            waited = await omni.submit("text-to-text", prompt="wait", params={"ar": {"max_tokens": 3}}, wait=30)
            assert waited.status == "succeeded" and waited.outputs[0].text

    asyncio.run(scenario())


def test_a_bad_key_and_a_quota_refusal_raise_their_own_errors_with_the_servers_values(system: EmbeddedSystem) -> None:
    with Client(system.api_url, api_key="ok_not-a-key") as stranger, pytest.raises(UnauthorizedError) as refused:
        stranger.list()
    assert refused.value.status_code == 401 and refused.value.message.startswith("missing or invalid API key")
    assert refused.value.headers["www-authenticate"].startswith("Bearer")

    subprocess.run([sys.executable, "-m", "omni_jobs.cli", "keys", "limits", "--tenant", "client-quota",
                    "--per-minute", "1"], cwd=ROOT, env=system.child_env(), capture_output=True, timeout=60, check=True)
    with Client(system.api_url, api_key=system.create_api_key("client-quota")) as omni:
        first = omni.submit("dit-only", prompt="the one this minute allows")
        with pytest.raises(RateLimitedError) as limited:
            omni.submit("dit-only", prompt="one too many")
        assert omni.wait(first.id, timeout=60).status == "succeeded"
    error = limited.value
    assert (error.status_code, error.limit, error.value) == (429, "jobs_per_minute", 1)
    assert error.retry_after_s is not None and 1 <= error.retry_after_s <= 60
    assert "tenant 'client-quota' reached its limit jobs_per_minute=1" in str(error)
