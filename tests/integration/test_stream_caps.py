"""Long requests (SSE streams, Prefer: wait, the OpenAI routes' waits) are capped per tenant and per API process (issue 62): each
holds a Redis connection while it blocks, and the pool had no bound, so thousands of streams from one
key reached Redis's maxclients, and the workers, on the same Redis, failed.

A real uvicorn process (a TestClient runs one request at a time), the session's Redis, no workers: the
submitted jobs wait on their queues, so their streams stay open."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import redis

from omni_jobs.accept.auth import ApiKeys
from omni_jobs.local.devservices import RunningService, free_port

pytestmark = pytest.mark.integration

DB = 9
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def api(redis_service: RunningService, tmp_path: Path) -> Iterator[tuple[str, redis.Redis]]:
    url = f"redis://127.0.0.1:{redis_service.port}/{DB}"
    port = free_port()
    env = {**os.environ, "OMNI_REDIS_URL": url, "OMNI_ARTIFACTS_DIR": str(tmp_path / "a"),
           "OMNI_MODELS_DIR": str(tmp_path / "m"), "OMNI_LOG_FORMAT": "text",
           "OMNI_MAX_STREAMS_PER_TENANT": "2", "OMNI_MAX_STREAMS": "3",
           "OMNI_OPENAI_WAIT_S": "4"}
    log = (tmp_path / "api.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "api.main:app", "--port", str(port)], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    client = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "api.log").read_text()
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", client
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        client.flushdb()
        client.close()


def tenant(base: str, state: redis.Redis, name: str) -> tuple[httpx.Client, str]:
    """A client with a key of tenant ``name``, and a job of it that waits (no worker runs)."""
    client = httpx.Client(base_url=base, timeout=30,
                          headers={"authorization": f"Bearer {ApiKeys(state).create(name)[0]}"})
    job = client.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "wait"}})
    assert job.status_code == 202, job.text
    return client, job.json()["id"]


OPEN: list[object] = []
"""The open streams' line iterators: one dropped closes its stream."""


def open_stream(stack: ExitStack, client: httpx.Client, job_id: str) -> httpx.Response:
    response = stack.enter_context(client.stream("GET", f"/v1/jobs/{job_id}/events"))
    if response.status_code == 200:
        lines = response.iter_lines()
        OPEN.append(lines)
        assert next(lines).startswith("retry:")  # the stream is open, holding its place
    else:
        response.read()
    return response


def test_streams_and_waits_are_capped_per_tenant_and_per_process(api: tuple[str, redis.Redis]) -> None:
    base, state = api
    a, a_job = tenant(base, state, "tenant-a")
    b, b_job = tenant(base, state, "tenant-b")
    with ExitStack() as held:
        assert [open_stream(held, a, a_job).status_code for _ in range(2)] == [200, 200]
        third = open_stream(held, a, a_job)
        assert third.status_code == 429 and third.headers["retry-after"]
        assert "OMNI_MAX_STREAMS_PER_TENANT" in third.json()["detail"]
        # A's Prefer: wait would be one more: the submit is answered at once, the preference not applied.
        started = time.monotonic()
        waited = a.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "x"}},
                        headers={"prefer": "wait=10"})
        assert waited.status_code == 202 and time.monotonic() - started < 5
        assert "preference-applied" not in waited.headers
        # The process's own cap: B's first stream fills it (3), B's second is a 503.
        assert open_stream(held, b, b_job).status_code == 200
        full = open_stream(held, b, b_job)
        assert full.status_code == 503 and "OMNI_MAX_STREAMS" in full.json()["detail"]
    OPEN.clear()
    # Closed streams give their places back (the server sees the disconnect and stops following).
    deadline = time.monotonic() + 10
    while True:
        with ExitStack() as again:
            if open_stream(again, a, a_job).status_code == 200:
                break
        assert time.monotonic() < deadline, "closed streams kept their places"
        time.sleep(0.2)
    a.close()
    b.close()


def places_back(client: httpx.Client, job_id: str, n: int) -> None:
    """Wait until the tenant holds ``n`` streams at once again: a closed stream's place comes back when the
    server sees the disconnect, a moment later."""
    deadline = time.monotonic() + 10
    while True:
        with ExitStack() as probe:
            if all(open_stream(probe, client, job_id).status_code == 200 for _ in range(n)):
                break
        OPEN.clear()
        assert time.monotonic() < deadline, "closed streams kept their places"
        time.sleep(0.2)
    OPEN.clear()


CHAT = {"model": "text-to-text", "messages": [{"role": "user", "content": "wait"}], "max_tokens": 2}


def jobs_of(client: httpx.Client) -> int:
    return len(client.get("/v1/jobs", params={"limit": 100}).raise_for_status().json()["data"])


def test_an_openai_answer_waits_in_a_place_and_none_left_starts_no_job(api: tuple[str, redis.Redis]) -> None:
    base, state = api
    a, a_job = tenant(base, state, "tenant-a")
    with ExitStack() as held:
        assert [open_stream(held, a, a_job).status_code for _ in range(2)] == [200, 200]
        before = jobs_of(a)
        refused = a.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 429 and refused.headers["retry-after"], refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert "OMNI_MAX_STREAMS_PER_TENANT" in refused.json()["error"]["message"]
        assert jobs_of(a) == before  # refused before its job was made: nothing runs for an error
    OPEN.clear()
    places_back(a, a_job, 2)
    with ExitStack() as held, ThreadPoolExecutor(1) as pool:
        before = jobs_of(a)
        waiting = pool.submit(a.post, "/v1/chat/completions", json=CHAT)  # no worker: it waits OMNI_OPENAI_WAIT_S
        deadline = time.monotonic() + 10
        while jobs_of(a) == before:  # its job is made once it holds its place
            assert time.monotonic() < deadline and not waiting.done(), "the chat made no job"
            time.sleep(0.05)
        assert open_stream(held, a, a_job).status_code == 200
        assert open_stream(held, a, a_job).status_code == 429  # the waiting answer holds the other place
        assert waiting.result().status_code == 504  # the wait ran out: its place is given back
        OPEN.clear()
    places_back(a, a_job, 2)  # the answer and the streams gave theirs back
    a.close()


def test_a_streamed_openai_answer_keeps_alive_and_ends_with_a_timeout_error(api: tuple[str, redis.Redis]) -> None:
    """No worker runs: the job outlasts OMNI_OPENAI_WAIT_S (4 s). The chat stream and the speech SSE send their
    first chunk, then (the deadline is due with the first keep-alive) OpenAI's error naming the job; a pcm body
    just ends."""
    base, state = api
    a, _ = tenant(base, state, "tenant-a")
    with a.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as chat:
        assert chat.status_code == 200
        lines = [line for line in chat.iter_lines() if line]
    job_id = chat.headers["x-omni-job-id"]
    assert lines[0].startswith("data: ") and '"role":"assistant"' in lines[0]
    assert all(line == ": keep-alive" for line in lines[1:-1])  # nothing was said
    last = json.loads(lines[-1].removeprefix("data: "))
    assert last["error"]["code"] == "job_timeout" and job_id in last["error"]["message"]
    speech = {"model": "text-to-speech", "input": "hello", "voice": "Chelsie", "response_format": "pcm"}
    with a.stream("POST", "/v1/audio/speech", json={**speech, "stream_format": "sse"}) as events:
        assert events.status_code == 200
        lines = [line for line in events.iter_lines() if line]
    last = json.loads(lines[-1].removeprefix("data: "))
    assert last["type"] == "error" and last["error"]["code"] == "job_timeout", lines
    started = time.monotonic()
    with a.stream("POST", "/v1/audio/speech", json=speech) as body:
        assert body.status_code == 200 and body.read() == b""  # nothing was said before the wait ran out
    assert 3 < time.monotonic() - started < 15
    a.close()
