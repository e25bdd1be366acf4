"""Text as it is generated, through the HTTP API and real workers: the job's ``output.delta`` events,
chat completions with ``stream: true`` read by the official ``openai`` client, ``omni_jobs.client``'s
``stream_text``, cancel while streaming, and SSE resume with the deltas."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from omni_jobs.client import AsyncClient, Client, JobEventInfo
from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.helpers import submit, wait_for_job

PROMPT = "Tell me everything"
MAX_TOKENS = 400
"""The tiny random model runs this prompt to its budget (no EOS): 0.6 s or more of generation on an
idle CPU, so several 50 ms deltas even then."""


@pytest.fixture
def client(system: EmbeddedSystem) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{system.api_url}/v1", api_key=system.api_key, timeout=180) as c:
        yield c


@pytest.fixture
def omni(system: EmbeddedSystem) -> Iterator[Client]:
    with Client(system.api_url, api_key=system.api_key, timeout=60) as c:
        yield c


def deltas_of(events: list[JobEventInfo]) -> list[JobEventInfo]:
    return [e for e in events if e.type == "output.delta"]


def test_a_jobs_deltas_join_to_its_text_output_and_a_resumed_stream_replays_the_missed_ones(
        api: httpx.Client, omni: Client, system: EmbeddedSystem) -> None:
    job = submit(api, "text-to-text", PROMPT, {"ar": {"max_tokens": MAX_TOKENS}})
    pieces = list(omni.stream_text(job["id"]))  # followed live, from the start
    final = wait_for_job(api, job["id"])
    assert final["status"] == "succeeded"
    text = final["outputs"][0]["text"]
    assert len(pieces) >= 3 and "".join(pieces) == text

    history = list(omni.events(job["id"]))  # the finished job's stream replays everything
    deltas = deltas_of(history)
    assert "".join(d.data["text"] for d in deltas) == text
    assert [d.data["index"] for d in deltas] == list(range(len(deltas)))
    assert all((d.data["stage"], d.data["output"], d.data["attempt"]) == ("ar", "text", 1) for d in deltas)
    # at most one write per 50 ms while it runs; the rest goes with the stage's result, without waiting.
    # Where the writer's own tick took the end of the text just before the stage ended, nothing is left
    # for the result, and the stage's last progress can come between: never another delta.
    assert min(b.at - a.at for a, b in itertools.pairwise(deltas[:-1])) >= 0.045
    after_last = [e.type for e in history[history.index(deltas[-1]) + 1:]]
    assert set(after_last[:after_last.index("stage.succeeded")]) <= {"stage.progress"}, after_last
    types = [e.type for e in history]
    started, succeeded = types.index("stage.started"), types.index("stage.succeeded")
    at = [i for i, t in enumerate(types) if t == "output.delta"]
    assert started < at[0] and at[-1] < succeeded  # published while the stage ran, before its result

    # Reconnecting after the second delta replays the rest, deltas included, and nothing before.
    resumed = list(omni.events(job["id"], last_event_id=deltas[1].id))
    assert [e.id for e in resumed] == [e.id for e in history[history.index(deltas[1]) + 1:]]
    rest = "".join(omni.stream_text(job["id"], last_event_id=deltas[1].id))
    assert deltas[0].data["text"] + deltas[1].data["text"] + rest == text

    async def stream_async() -> str:
        async with AsyncClient(system.api_url, api_key=system.api_key) as aomni:
            return "".join([piece async for piece in aomni.stream_text(job["id"])])

    assert asyncio.run(stream_async()) == text


def test_a_job_nobody_follows_writes_its_text_as_one_delta_when_the_stage_ends(
        api: httpx.Client, omni: Client) -> None:
    """Deltas go out while a reader follows the job (OMNI_TEXT_DELTAS=followed, the default); a job
    nobody follows keeps its stream to one delta, and a reader that comes afterwards sees the text."""
    job = submit(api, "text-to-text", PROMPT, {"ar": {"max_tokens": MAX_TOKENS}})
    final = wait_for_job(api, job["id"])  # polled, not followed
    assert final["status"] == "succeeded"
    text = final["outputs"][0]["text"]
    events = list(omni.events(job["id"]))
    deltas = deltas_of(events)
    assert [(d.data["text"], d.data["index"]) for d in deltas] == [(text, 0)]
    # written by the stage's completion, in the same step: just before its stage.succeeded
    after = events[events.index(deltas[0]) + 1]
    assert after.type == "stage.succeeded" and after.data["stage"] == "ar"
    assert "".join(omni.stream_text(job["id"])) == text


def test_openai_stream_yields_chunks_that_join_to_the_non_streamed_answer(client: OpenAI, api: httpx.Client) -> None:
    messages: Any = [{"role": "user", "content": PROMPT}]
    stream = client.chat.completions.create(model="text-to-text", messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, seed=11, stream=True,
                                            stream_options={"include_usage": True})
    chunks = []
    first_content_at = None
    for chunk in stream:
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content and first_content_at is None:
            first_content_at = time.time()
    job_id = chunks[0].id.removeprefix("chatcmpl-")
    job = api.get(f"/v1/jobs/{job_id}").raise_for_status().json()
    assert job["status"] == "succeeded" and job["params"]["ar"]["seed"] == 11
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" and c.model == "text-to-text"
               for c in chunks)

    role, *contents, finish, usage = chunks
    assert role.choices[0].delta.role == "assistant" and not role.choices[0].delta.content
    assert len(contents) >= 3 and all(c.choices[0].delta.content and c.choices[0].finish_reason is None
                                      for c in contents)
    assert first_content_at is not None and first_content_at < job["completed_at"]  # while the job ran
    streamed = "".join(c.choices[0].delta.content or "" for c in contents)
    assert streamed == job["outputs"][0]["text"]
    assert usage.choices == [] and usage.usage is not None
    made = usage.usage.completion_tokens
    assert 0 < made <= MAX_TOKENS and usage.usage.prompt_tokens > 0
    assert usage.usage.total_tokens == usage.usage.prompt_tokens + made
    # vLLM's own finish reason: 'length' at the budget, 'stop' when the model ended (EOS) before it
    assert finish.choices[0].finish_reason == ("length" if made == MAX_TOKENS else "stop")
    assert not finish.choices[0].delta.content

    # The same seed at temperature 0, not streamed: the same text, finish_reason and usage.
    whole = client.chat.completions.create(model="text-to-text", messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0, seed=11)
    assert whole.choices[0].message.content == streamed
    assert whole.choices[0].finish_reason == finish.choices[0].finish_reason and whole.usage == usage.usage
    short = client.chat.completions.create(model="text-to-text", messages=messages, max_tokens=4)
    assert short.choices[0].finish_reason == "length" and short.usage is not None
    assert short.usage.completion_tokens == 4 and short.usage.prompt_tokens == usage.usage.prompt_tokens


def test_cancel_while_streaming_stops_the_job_and_ends_the_stream_with_an_error(
        client: OpenAI, api: httpx.Client, system: EmbeddedSystem) -> None:
    long = 480
    stream = client.chat.completions.create(model="text-to-text", max_tokens=long, stream=True,
                                            messages=[{"role": "user", "content": PROMPT}])
    job_id = ""
    received = 0
    with pytest.raises(openai.APIError) as err:
        for chunk in stream:
            job_id = chunk.id.removeprefix("chatcmpl-")
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
                if received == 1:
                    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    assert err.value.code == "job_canceled" and job_id in err.value.message
    final = wait_for_job(api, job_id)
    assert final["status"] == "canceled" and final["stages"][0]["status"] == "canceled"

    time.sleep(0.5)  # the worker stops at its next token; nothing reaches the stream after the cancel
    with Client(system.api_url, api_key=system.api_key) as omni:
        events = list(omni.events(job_id))
    canceled_at = next(i for i, e in enumerate(events) if e.type == "job.canceled")
    assert events[-1].type == "job.canceled"
    assert not [e for e in events[canceled_at + 1:] if e.type == "output.delta"]
    tokens = [e.data["step"] for e in events if e.type == "stage.progress"]
    assert tokens and max(tokens) < long  # stopped well before its budget


def test_a_failing_job_ends_its_stream_with_an_error_chunk(client: OpenAI) -> None:
    stream = client.chat.completions.create(model="broken-model", stream=True,
                                            messages=[{"role": "user", "content": "hi"}])
    chunks: list[Any] = []
    with pytest.raises(openai.APIError) as err:
        chunks.extend(stream)
    assert [c.choices[0].delta.role for c in chunks] == ["assistant"]  # the role chunk, then the error
    assert err.value.code == "job_failed" and "/nonexistent/omni-model" in err.value.message


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"modalities": ["text", "image"]}, "stream"), ({"stream": False, "stream_options": {"include_usage": True}},
                                                     "stream_options")],
    ids=["image-streamed", "options-without-stream"],
)
def test_streams_that_cannot_be_served_are_400(api: httpx.Client, extra: dict[str, Any], param: str) -> None:
    body = {"model": "text-to-image", "messages": [{"role": "user", "content": "x"}], "stream": True, **extra}
    response = api.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
