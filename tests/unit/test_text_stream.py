"""The text-delta buffer: every character once, in order, at most one delta per output per interval."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest

from omni_jobs.run.text_stream import DeltaReader, TextDeltas, TextStreams
from tests.waiting import wait_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class Recorder:
    """A publish function that records each delta with the time it went out."""

    def __init__(self, clock: Any = time.monotonic, answer: str = "ok") -> None:
        self.clock = clock
        self.answer = answer
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def __call__(self, data: dict[str, Any]) -> str:
        with self.lock:
            if self.answer == "ok":
                self.events.append((self.clock(), dict(data)))
            return self.answer

    @property
    def texts(self) -> list[str]:
        return [d["text"] for _at, d in self.events]


def test_inline_deltas_are_cut_by_the_interval_and_join_to_the_final_text() -> None:
    clock = FakeClock()
    sent = Recorder(clock)
    deltas = TextDeltas("ar", "text", sent, interval_s=0.05, attempt=1, inline=True, clock=clock, sleep=clock.sleep)
    text = ""
    for token in ["Once", " upon", " a", " time", ",", " a", " fox", " ran", "."]:
        text += token
        deltas.update(text)
        clock.now += 0.02  # a token every 20 ms: a delta every third token
    text += " The end"  # the engine's final answer: one more token than the last report
    assert deltas.close(text) == "ok"

    assert "".join(sent.texts) == text == deltas.published
    assert sent.texts == ["Once", " upon a time", ", a fox", " ran. The end"]
    assert [d["index"] for _at, d in sent.events] == [0, 1, 2, 3] and deltas.count == 4
    assert all(d["stage"] == "ar" and d["output"] == "text" and d["attempt"] == 1 for _at, d in sent.events)
    times = [at for at, _d in sent.events]
    assert min(b - a for a, b in itertools.pairwise(times)) >= 0.05 - 1e-9
    assert clock.slept == []  # the interval had passed: close published at once


def test_close_waits_out_the_interval_before_the_last_delta() -> None:
    clock = FakeClock()
    sent = Recorder(clock)
    deltas = TextDeltas("ar", "text", sent, interval_s=0.05, inline=True, clock=clock, sleep=clock.sleep)
    deltas.update("Hel")
    clock.now += 0.01
    deltas.update("Hello")
    assert deltas.close("Hello!") == "ok"
    assert sent.texts == ["Hel", "lo!"] and clock.slept == [pytest.approx(0.04)]
    assert sent.events[1][0] - sent.events[0][0] == pytest.approx(0.05)


def test_close_publishes_the_final_text_even_when_no_token_was_reported() -> None:
    clock = FakeClock()
    sent = Recorder(clock)
    deltas = TextDeltas("ar", "text", sent, inline=True, clock=clock, sleep=clock.sleep)
    assert deltas.close("all at once") == "ok"
    assert sent.texts == ["all at once"] and clock.slept == []
    empty = TextDeltas("ar", "text", sent, inline=True, clock=clock, sleep=clock.sleep)
    assert empty.close("") == "ok" and len(sent.events) == 1  # no empty delta


def test_finish_hands_the_rest_to_its_caller_instead_of_publishing_it() -> None:
    """The stage writes its text's last delta with its result: finish publishes nothing itself, even
    where the interval has passed, and the delta it returns follows the published ones."""
    clock = FakeClock()
    sent = Recorder(clock)
    deltas = TextDeltas("ar", "text", sent, interval_s=0.05, attempt=2, inline=True, clock=clock, sleep=clock.sleep)
    deltas.update("Once")
    clock.now += 0.01
    deltas.update("Once upon")  # within the interval: held
    clock.now += 1
    assert deltas.finish("Once upon a time") == ("ok", {"stage": "ar", "output": "text", "text": " upon a time",
                                                        "index": 1, "attempt": 2})
    assert sent.texts == ["Once"] and clock.slept == []
    deltas.update("Once upon a time, more")  # the writer leaves a finished output alone
    assert sent.texts == ["Once"]

    nothing = TextDeltas("ar", "text", sent, inline=True, clock=clock, sleep=clock.sleep)
    nothing.update("all")
    assert nothing.finish("all") == ("ok", None) and sent.texts == ["Once", "all"]
    refused = TextDeltas("ar", "text", Recorder(clock, answer="lost"), inline=True, clock=clock, sleep=clock.sleep)
    refused.update("a")
    assert refused.finish("ab") == ("lost", None)


def test_the_writer_thread_leaves_a_finished_output_to_its_caller() -> None:
    sent = Recorder()
    streams = TextStreams(interval_s=0.2)
    deltas = streams.open("ar", "text", sent, attempt=1)
    deltas.update("Hello")
    deadline = time.monotonic() + 5
    while sent.texts != ["Hello"] and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sent.texts == ["Hello"]
    deltas.update("Hello wor")
    why, rest = streams.finish(deltas, "Hello world")
    assert why == "ok" and rest is not None and rest["text"] == " world" and rest["index"] == 1
    time.sleep(0.3)  # past the interval: the writer would have published " wor" by now
    assert sent.texts == ["Hello"]


def test_a_refused_publish_stops_the_output_and_says_why() -> None:
    clock = FakeClock()
    sent = Recorder(clock)
    stops: list[str] = []
    deltas = TextDeltas("ar", "text", sent, inline=True, clock=clock, sleep=clock.sleep, on_stop=stops.append)
    deltas.update("Hello")
    sent.answer = "canceled"
    clock.now += 1
    deltas.update("Hello world")
    assert deltas.stopped == "canceled" and stops == ["canceled"]
    assert deltas.close("Hello world!") == "canceled"
    assert sent.texts == ["Hello"] and deltas.published == "Hello"


def test_text_that_takes_back_what_was_reported_is_refused() -> None:
    deltas = TextDeltas("ar", "text", Recorder(), inline=False)
    deltas.update("Hello")
    with pytest.raises(RuntimeError, match="cannot take text back"):
        deltas.update("Help")


def test_the_writer_thread_publishes_while_tokens_come_and_close_flushes_the_rest() -> None:
    streams = TextStreams(background=True, interval_s=0.05)
    sent = Recorder()
    deltas = streams.open("ar", "text", sent, attempt=2)
    text = ""
    started = time.monotonic()
    for i in range(120):  # a token every 2 ms for ~0.25 s, from the "engine thread"
        text += f" t{i}"
        deltas.update(text)
        time.sleep(0.002)
    assert len(sent.events) >= 2  # published meanwhile, not only at the end
    assert streams.close(deltas, text) == "ok"
    elapsed = time.monotonic() - started

    assert "".join(sent.texts) == text
    assert [d["index"] for _at, d in sent.events] == list(range(len(sent.events)))
    times = [at for at, _d in sent.events]
    assert min(b - a for a, b in itertools.pairwise(times)) >= 0.05 - 1e-3
    assert len(sent.events) <= elapsed / 0.05 + 1  # far fewer events than tokens
    deltas.update(text + " more")  # after close nothing is written any more
    time.sleep(0.1)
    assert "".join(sent.texts) == text


def test_outputs_stream_independently() -> None:
    streams = TextStreams(background=True, interval_s=0.05)
    a_sent, b_sent = Recorder(), Recorder()
    a = streams.open("ar", "text", a_sent)
    b = streams.open("ar2", "text", b_sent)
    a.update("alpha")
    b.update("beta")
    wait_until(lambda: a_sent.texts and b_sent.texts, what="the first deltas")
    assert a_sent.texts == ["alpha"] and b_sent.texts == ["beta"]  # each output's first delta goes at once
    a.update("alpha beta")
    streams.discard(b)
    b.update("beta gamma")  # a discarded output (its attempt ended) is not written any more
    assert streams.close(a) == "ok"
    time.sleep(0.1)
    assert a_sent.texts == ["alpha", " beta"] and b_sent.texts == ["beta"]


def delta(text: str, index: int, *, stage: str = "ar", output: str = "text", attempt: int = 1) -> dict[str, Any]:
    return {"stage": stage, "output": output, "text": text, "index": index, "attempt": attempt}


def test_a_reader_hands_out_each_character_once_even_when_a_second_attempt_repeats_the_text() -> None:
    reader = DeltaReader()  # follows the first stage that streams 'text'
    pieces = [reader.feed(d) for d in [
        delta("Once", 0), delta(" upon", 1), delta("ignored", 0, stage="other"), delta("x", 0, output="caption"),
        delta("On", 0, attempt=2), delta("ce upon a", 1, attempt=2), delta(" time", 2, attempt=2)]]
    assert pieces == ["Once", " upon", "", "", "", " a", " time"]
    assert reader.text == "Once upon a time" and reader.stage == "ar"
    named = DeltaReader("other")
    assert named.feed(delta("Once", 0)) == "" and named.feed(delta("Hi", 0, stage="other")) == "Hi"


def test_the_writer_publishes_the_deltas_due_together_in_one_call() -> None:
    calls: list[list[str]] = []
    fail_next = threading.Event()

    def publish_many(items: Any) -> list[str]:
        if fail_next.is_set():
            fail_next.clear()
            raise ConnectionError("store down")
        calls.append([data["text"] for _publish, data in items])
        return ["canceled" if data["text"].startswith("doomed") else "ok" for _publish, data in items]

    streams = TextStreams(background=True, interval_s=0.05, publish_many=publish_many)
    stops: list[str] = []
    outputs = [streams.open(f"ar{i}", "text", Recorder()) for i in range(3)]
    doomed = streams.open("ar9", "text", Recorder(), on_stop=stops.append)
    for i, deltas in enumerate(outputs):  # one engine step reports every member
        deltas.update(f"step one of {i}")
    doomed.update("doomed text")
    wait_until(lambda: calls and doomed.stopped, what="the first write")
    assert sorted(calls[0]) == ["doomed text", "step one of 0", "step one of 1", "step one of 2"]  # one write
    assert doomed.stopped == "canceled" and stops == ["canceled"]  # only that output stops

    fail_next.set()  # a failed write keeps the text pending: it goes out, whole, in the next one
    for i, deltas in enumerate(outputs):
        deltas.update(f"step one of {i}, two")
    wait_until(lambda: len(calls) >= 2 and all(d.count == 2 for d in outputs), what="the write after the failed one")
    assert sorted(calls[1]) == [", two", ", two", ", two"] and len(calls) == 2
    assert [d.published for d in outputs] == [f"step one of {i}, two" for i in range(3)]
    assert [d.count for d in outputs] == [2, 2, 2] and doomed.published == ""


def test_a_workers_deltas_are_spaced_by_its_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """OMNI_TEXT_DELTA_INTERVAL_MS reaches the stage runner's writer; 0 or less is refused by name."""
    from pydantic import ValidationError

    from omni_jobs.core.settings import Settings
    from omni_jobs.runtime import Runtime

    monkeypatch.setenv("OMNI_TEXT_DELTA_INTERVAL_MS", "250")
    settings = Settings(redis_url="redis://unused:1/0", artifacts_dir=tmp_path, engine_turns="off")
    streams = Runtime(settings).stage_runner.reports.text_streams
    assert streams.interval_s == 0.25
    deltas = streams.open("ar", "text", lambda data: "ok")
    assert deltas.interval_s == 0.25
    streams.discard(deltas)
    monkeypatch.setenv("OMNI_TEXT_DELTA_INTERVAL_MS", "0")
    with pytest.raises(ValidationError, match="text_delta_interval_ms"):
        Settings()


def test_text_nobody_follows_is_kept_for_the_stages_end_and_flows_once_a_reader_comes() -> None:
    """With ``followed``, a job's deltas go out only while a reader follows it; the writer asks at most
    every ``follow_check_s`` (not at every step), and the deltas still add up to the whole text."""
    asked: list[list[str]] = []
    readers: set[str] = set()

    def followed(job_ids: Any) -> set[str]:
        asked.append(list(job_ids))
        return {j for j in job_ids if j in readers}

    streams = TextStreams(background=True, interval_s=0.02, followed=followed, follow_check_s=0.1)
    lone, watched = Recorder(), Recorder()
    a = streams.open("ar", "text", lone, job_id="job_lone")
    b = streams.open("ar", "text", watched, job_id="job_watched")
    readers.add("job_watched")
    text = ""
    started = time.monotonic()
    for i in range(50):  # an engine step every 10 ms for ~0.5 s
        text += f" t{i}"
        a.update(text)
        b.update(text)
        time.sleep(0.01)
        if i == 25:
            readers.add("job_lone")  # a reader comes for the other job half-way
            flowing_from = len(lone.events)
    assert flowing_from == 0  # nothing of the lone job went out before its reader came
    assert len(lone.events) >= 2 and lone.texts[0].startswith(" t0 t1")  # then all it had, at once, and on
    assert len(watched.events) >= 10
    assert len(asked) <= (time.monotonic() - started) / 0.1 + 3  # every check period, not at every step
    assert streams.close(a, text) == "ok" and streams.close(b, text) == "ok"
    assert "".join(lone.texts) == text and "".join(watched.texts) == text

    never = Recorder()
    c = streams.open("ar", "text", never, job_id="job_never")
    for i in range(20):
        c.update(f"{'x' * i}")
        time.sleep(0.01)
    assert never.events == []
    assert streams.close(c, "x" * 25) == "ok"
    assert never.texts == ["x" * 25]  # one delta, the whole text, as the stage ends


def test_the_writer_publishes_when_it_cannot_tell_who_follows() -> None:
    def followed(job_ids: Any) -> set[str]:
        raise ConnectionError("store down")

    streams = TextStreams(background=True, interval_s=0.02, followed=followed)
    sent = Recorder()
    deltas = streams.open("ar", "text", sent, job_id="job_x")
    deltas.update("Hello")
    deadline = time.monotonic() + 5
    while not sent.texts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent.texts == ["Hello"]
    streams.discard(deltas)
