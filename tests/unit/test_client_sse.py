"""The client's SSE framing and its event-stream bookkeeping (omni_jobs/client/sse.py, EventStream),
then both clients following a stream that drops mid-way (httpx's MockTransport plays the server)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from omni_jobs.client import AsyncClient, Client, JobEventView
from omni_jobs.client.protocol import DEFAULT_RETRY_S, EventStream
from omni_jobs.client.sse import SseMessage, SseParser
from tests.own_loop import run_in_own_loop


def feed_all(parser: SseParser, lines: list[str]) -> list[SseMessage]:
    return [m for m in (parser.feed(line) for line in lines) if m is not None]


def test_data_lines_of_one_message_join_with_newlines() -> None:
    messages = feed_all(SseParser(), ["data: first", "data: second", "data:", "data:  indented", ""])
    assert messages == [SseMessage(event="message", data="first\nsecond\n\n indented", id="")]


def test_comments_are_skipped_and_a_block_without_data_dispatches_nothing() -> None:
    parser = SseParser()
    assert feed_all(parser, [": keep-alive", "", "event: ignored", "", ":", "data:x", ""]) == [
        SseMessage(event="message", data="x", id="")]  # the event name of the empty block did not carry over


def test_an_id_stays_in_force_until_the_next_and_a_nul_id_is_ignored() -> None:
    parser = SseParser(last_event_id="1-0")
    lines = ["data: a", "", "id: 5-0", "event: stage.progress", "data: b", "", "data: c", "",
             "id: bad\0id", "data: d", "", "id", "data: e", ""]
    assert [(m.id, m.event, m.data) for m in feed_all(parser, lines)] == [
        ("1-0", "message", "a"), ("5-0", "stage.progress", "b"), ("5-0", "message", "c"), ("5-0", "message", "d"),
        ("", "message", "e")]  # a bare "id" line resets it


def test_retry_sets_the_reconnection_delay_only_when_it_is_digits() -> None:
    parser = SseParser()
    assert feed_all(parser, ["retry: 2000", ""]) == []
    assert parser.retry_ms == 2000
    feed_all(parser, ["retry: 1.5", "retry: -3", "retry: ", ""])
    assert parser.retry_ms == 2000


def test_a_byte_order_mark_and_a_field_without_colon() -> None:
    messages = feed_all(SseParser(), ["\ufeffevent: job.queued", "data", ""])
    assert messages == [SseMessage(event="job.queued", data="", id="")]


def event_line(event_id: str, type_: str, **data: Any) -> list[str]:
    payload = {"id": event_id, "job_id": "job_1", "type": type_, "at": 1.5, "data": data}
    return [f"id: {event_id}", f"event: {type_}", f"data: {json.dumps(payload)}", ""]


def test_event_stream_resumes_after_the_last_event_read_and_backs_off() -> None:
    stream = EventStream("job_1", reconnect=2, timeout=5)
    first = stream.next_call()
    assert first is not None and first.url == "/v1/jobs/job_1/events" and "last-event-id" not in first.headers
    assert first.headers["accept"] == "text/event-stream"
    assert isinstance(first.timeout, httpx.Timeout) and first.timeout.read == 60.0 and first.timeout.connect == 5
    events = [e for line in ["retry: 500", "", *event_line("7-0", "job.queued"),
                             *event_line("8-0", "stage.progress", stage="dit", step=1, total=4),
                             "id: 9-0", "data: {\"cut\""] for e in [stream.feed(line)] if e is not None]
    assert [(e.id, e.type) for e in events] == [("7-0", "job.queued"), ("8-0", "stage.progress")]
    assert stream.retry_s == 0.5 and stream.last_event_id == "8-0"  # 9-0 was never completed: not resumed after

    stream.dropped(httpx.ReadError("reset"))
    assert (stream.failures, stream.pause_s) == (1, 0.4)
    again = stream.next_call()
    assert again is not None and again.headers["last-event-id"] == "8-0"
    stream.dropped(httpx.ConnectError("refused"))
    assert (stream.failures, stream.pause_s) == (2, 0.5)  # 0.8 s, capped by the server's retry
    with pytest.raises(httpx.ConnectError):
        stream.dropped(httpx.ConnectError("refused again"))  # a third failure in a row: reconnect=2 is spent


def test_an_event_resets_the_failures_and_the_final_event_ends_the_stream() -> None:
    stream = EventStream("job_1", last_event_id="3-0")
    stream.dropped(httpx.ReadError("reset"))
    stream.next_call()
    final = [e for line in event_line("4-0", "job.succeeded") for e in [stream.feed(line)] if e is not None]
    assert final[0].is_final and final[0].job is None
    assert stream.failures == 0 and stream.done and stream.next_call() is None
    assert EventStream("job_1").retry_s == DEFAULT_RETRY_S


class Script:
    """The server's side of each connection, for both clients: each one is a list of SSE lines,
    optionally cut by a transport error after its lines (a dropped connection)."""

    def __init__(self, connections: list[tuple[list[str], bool]]) -> None:
        self.connections = connections
        self.seen: list[str | None] = []  # the Last-Event-ID of each request

    def respond(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request.headers.get("last-event-id"))
        lines, cut = self.connections[len(self.seen) - 1]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Body(lines, cut))


class Body(httpx.SyncByteStream, httpx.AsyncByteStream):
    def __init__(self, lines: list[str], cut: bool) -> None:
        self.chunks = [f"{line}\n".encode() for line in lines]
        self.cut = cut

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks
        if self.cut:
            raise httpx.ReadError("connection reset by peer")

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.cut:
            raise httpx.ReadError("connection reset by peer")


def dropping_script() -> Script:
    return Script([
        (["retry: 10", "", *event_line("1-0", "job.queued"), *event_line("2-0", "job.running"), "id: 3-0"], True),
        ([*event_line("3-0", "stage.started", stage="dit"), *event_line("4-0", "job.succeeded")], False),
    ])


def test_both_clients_reconnect_with_last_event_id_and_hand_out_each_event_once() -> None:
    sync_script, async_script = dropping_script(), dropping_script()
    with Client("http://api.test", api_key="ok_1", transport=httpx.MockTransport(sync_script.respond)) as omni:
        sync_ids = [e.id for e in omni.events("job_1")]

    async def follow() -> list[JobEventView]:
        transport = httpx.MockTransport(async_script.respond)
        async with AsyncClient("http://api.test", api_key="ok_1", transport=transport) as omni:
            return [e async for e in omni.events("job_1")]

    async_ids = [e.id for e in run_in_own_loop(follow())]
    assert sync_ids == async_ids == ["1-0", "2-0", "3-0", "4-0"]
    assert sync_script.seen == async_script.seen == [None, "2-0"]
