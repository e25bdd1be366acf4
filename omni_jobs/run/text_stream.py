"""Text as it is generated, cut into ``output.delta`` events: at most one per output every 50 ms.

An AR engine reports each request's text so far at every token, from the one thread that drives
the engine. An event per token would be a Redis write per token, made while the engine waits.
Progress may be coalesced (the newest report wins); text may not: every character must reach the
job's event stream once and in order. So each output (``TextDeltas``) keeps its text so far and how
much of it was published; a writer thread (``TextStreams``) publishes an output's unpublished rest
as ONE delta, with the next ``index``, once its last delta is ``interval_s`` old; the deltas of all
outputs due together go out in one call (``PublishMany``: one Redis round trip for a whole engine
step of a batch, not one per request). When the output is complete, ``finish`` hands what is left
to the stage runner as one last delta, which the stage's completion writes just before its
stage.succeeded (``close`` publishes it instead, after waiting out the interval), so the deltas of
an output, concatenated, are its final text. A publish answered 'canceled' or 'lost' is handed to
``on_stop`` (the stage runner marks the attempt stopped; it stops at its next token).
In-process use (``background=False``) publishes inline, from the engine's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from omni_jobs.core.json_types import JsonObject, JsonValue

log = logging.getLogger(__name__)

DELTA_INTERVAL_S = 0.05
"""The least time between two deltas of one output by default (the issue's 'at most one every 50 ms');
a worker's is ``OMNI_TEXT_DELTA_INTERVAL_MS``."""

FOLLOW_CHECK_S = 0.25
"""How often the writer asks whether a reader follows a job whose text it holds back (``followed``)."""

GATHER_S = 0.002
"""How long the writer lets the engine thread finish a step's updates before it takes what is due:
a batched engine reports every request of a step in one loop, and they should share one write."""

Publish = Callable[[JsonObject], str]
"""Appends one delta event (its data) to the job's stream: 'ok', or 'canceled' / 'lost'."""

PublishMany = Callable[[Sequence[tuple[Publish, JsonObject]]], list[str]]
"""Publishes several outputs' deltas at once (each with its output's ``Publish``); an outcome each."""


def publish_each(items: Sequence[tuple[Publish, JsonObject]]) -> list[str]:
    """The plain ``PublishMany``: one call per delta."""
    return [publish(data) for publish, data in items]


class TextDeltas:
    """One output's text so far, and the part of it already published as deltas."""

    def __init__(self, stage: str, output: str, publish: Publish, *, interval_s: float = DELTA_INTERVAL_S,
                 attempt: int | None = None, on_stop: Callable[[str], None] | None = None,
                 inline: bool = False, notify: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 job_id: str | None = None, field: str = "text") -> None:
        self.stage = stage
        self.output = output
        self.field = field
        """The delta's key for the new text ('codes' for a talker's codes, written as text: omni_jobs.run.code_stream)."""
        self.job_id = job_id
        """The job whose readers this text is for (the writer asks whether any follows it)."""
        self.interval_s = interval_s
        self.attempt = attempt
        self.publish = publish
        self._on_stop = on_stop
        self._inline = inline
        self._notify = notify
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()  # guards the fields below (engine thread vs writer)
        self._writing = threading.Lock()  # one publish at a time: indexes go out in order
        self._text = ""
        self._sent = 0
        self._index = 0
        self._last = float("-inf")
        self._held_until = float("-inf")
        self._closed = False
        self.stopped: str | None = None
        """'canceled' or 'lost' once a publish was refused; nothing more is published then."""

    @property
    def published(self) -> str:
        """The text published so far (the concatenation of the deltas)."""
        with self._lock:
            return self._text[: self._sent]

    @property
    def count(self) -> int:
        """How many deltas were published."""
        with self._lock:
            return self._index

    def update(self, text: str) -> None:
        """The output's text so far (the engine's thread): remembered, published when due.

        The text only grows (vLLM's detokenized text of a request without stop strings); a text
        that is not an extension of the last one would make the deltas disagree with the result."""
        with self._lock:
            if not text.startswith(self._text):
                raise RuntimeError(f"stage '{self.stage}' output '{self.output}': the text so far changed "
                                   "what it had already reported; deltas cannot take text back")
            was_idle = len(self._text) == self._sent
            self._text = text
            waiting = len(text) > self._sent and not self._closed  # closing: its caller takes the rest
        if not waiting:
            return
        if self._inline:
            self.flush()
        elif was_idle and self._notify is not None:
            self._notify()

    def due_in(self, now: float) -> float | None:
        """Seconds until the unpublished text may go out (<= 0: now); None when there is none."""
        with self._lock:
            if self._closed or self.stopped is not None or len(self._text) == self._sent:
                return None
            return max(self._last + self.interval_s, self._held_until) - now

    def hold(self, until: float) -> None:
        """The writer keeps the text back until then (nobody follows the job); ``close`` still
        publishes the rest, so the deltas always add up to the whole text."""
        with self._lock:
            self._held_until = until

    def flush(self, *, wait: bool = False) -> str:
        """Publish the unpublished text as one delta if its interval has passed (or, with ``wait``,
        once it has): 'ok' (published, or nothing due), else why the stage must stop."""
        with self._writing:
            with self._lock:
                if self.stopped is not None:
                    return self.stopped
                if len(self._text) == self._sent:
                    return "ok"
                left = self._last + self.interval_s - self._clock()
            if left > 0:
                if not wait:
                    return "ok"
                self._sleep(left)
            data = self._next_delta()
            outcome = self.publish(data)
            self._settle(data, outcome)
        self._stopped_by(outcome)
        return outcome

    def _next_delta(self) -> JsonObject:
        with self._lock:
            text, index = self._text[self._sent:], self._index
        data: JsonObject = {"stage": self.stage, "output": self.output, self.field: text, "index": index}
        if self.attempt is not None:
            data["attempt"] = self.attempt
        return data

    def _settle(self, data: JsonObject, outcome: str) -> None:
        """The delta ``data`` was published ('ok') or refused (the stage must stop)."""
        with self._lock:
            if outcome == "ok":
                self._sent += len(str(data[self.field]))
                self._index += 1
                self._last = self._clock()
            else:
                self.stopped = outcome

    def _stopped_by(self, outcome: str) -> None:
        """Outside the write turn: a refused publish stops the stage."""
        if outcome != "ok" and self._on_stop is not None:
            self._on_stop(outcome)

    def take_due(self) -> JsonObject | None:
        """For the writer: the delta to publish now, holding this output's write turn until
        ``settle_taken``; None when nothing is due (or ``close`` is writing it)."""
        if not self._writing.acquire(blocking=False):
            return None
        left = self.due_in(self._clock())
        if left is None or left > 0:
            self._writing.release()
            return None
        return self._next_delta()

    def settle_taken(self, data: JsonObject, outcome: str | None) -> None:
        """The writer's publish of a ``take_due`` delta ended: its outcome, or None when the publish
        failed (the text stays pending and is tried again)."""
        try:
            if outcome is not None:
                self._settle(data, outcome)
        finally:
            self._writing.release()
        if outcome is not None:
            self._stopped_by(outcome)

    def close(self, final_text: str | None = None) -> str:
        """The output is complete: publish the rest (``final_text`` is the engine's final answer),
        waiting out the interval. Returns 'ok', or why the stage must stop."""
        if final_text is not None:
            with self._lock:
                self._closed = True  # the writer leaves it alone from now on
            self.update(final_text)
        outcome = self.flush(wait=True)
        with self._lock:
            self._closed = True
        return outcome

    def finish(self, final_text: str | None = None) -> tuple[str, JsonObject | None]:
        """The output is complete: the rest of its text as the data of one last delta, which the
        caller writes with the stage's result (one write instead of two), or None when all of it
        went out. 'ok', or why the stage must stop (a publish was refused)."""
        with self._lock:
            self._closed = True  # the writer leaves it alone from now on
        if final_text is not None:
            self.update(final_text)
        with self._writing:  # a delta the writer is publishing now settles first
            with self._lock:
                if self.stopped is not None:
                    return self.stopped, None
                if len(self._text) == self._sent:
                    return "ok", None
            data = self._next_delta()
            self._settle(data, "ok")  # it goes out with the result
        return "ok", data


class TextStreams:
    """The writer of every open ``TextDeltas`` of a stage worker: one background thread, which
    publishes each output's pending text when its interval has passed."""

    def __init__(self, *, background: bool = True, interval_s: float = DELTA_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, publish_many: PublishMany = publish_each,
                 gather_s: float = GATHER_S, followed: Callable[[Sequence[str]], set[str]] | None = None,
                 follow_check_s: float = FOLLOW_CHECK_S) -> None:
        """``followed``: which of these jobs a reader follows now. Given, the writer publishes a job's
        text while it is followed (asking every ``follow_check_s``) and otherwise keeps it for the
        stage's end: on CPU cores, where an engine step outlasts the interval, every token of every
        request was a write of its own, whether anybody read it or not. None: always publish."""
        self.background = background
        self.interval_s = interval_s
        self.followed = followed
        self.follow_check_s = follow_check_s
        self._followed_jobs: set[str] = set()
        self._checked_at = float("-inf")
        self.publish_many = publish_many
        self.gather_s = gather_s
        self._clock = clock
        self._open: set[TextDeltas] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def open(self, stage: str, output: str, publish: Publish, *, attempt: int | None = None,
             on_stop: Callable[[str], None] | None = None, job_id: str | None = None,
             field: str = "text", interval_s: float | None = None) -> TextDeltas:
        """A new output to stream; ``close`` it (or ``discard`` it) when its stage attempt ends. ``job_id``: held
        back while nobody follows that job (None: always published, for a stage that reads it as it comes)."""
        deltas = TextDeltas(stage, output, publish, interval_s=self.interval_s if interval_s is None else interval_s,
                            attempt=attempt, on_stop=on_stop,
                            inline=not self.background, notify=self._wake, clock=self._clock, job_id=job_id,
                            field=field)
        if self.background:
            with self._cond:
                self._open.add(deltas)
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._loop, name="omni-text-deltas", daemon=True)
                    self._thread.start()
        return deltas

    def close(self, deltas: TextDeltas, final_text: str | None = None) -> str:
        """Publish the rest of the output (from the caller's thread) and stop writing it."""
        try:
            return deltas.close(final_text)
        finally:
            self.discard(deltas)

    def finish(self, deltas: TextDeltas, final_text: str | None = None) -> tuple[str, JsonObject | None]:
        """Stop writing the output; the rest of its text for the caller's write (``TextDeltas.finish``)."""
        try:
            return deltas.finish(final_text)
        finally:
            self.discard(deltas)

    def discard(self, deltas: TextDeltas) -> None:
        """Stop writing the output (its attempt failed or was stopped): what is pending is dropped."""
        with self._cond:
            self._open.discard(deltas)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _wait_due(self) -> None:
        """Until some output's pending text may go out."""
        with self._cond:
            while True:
                now = self._clock()
                waits = [left for d in self._open if (left := d.due_in(now)) is not None]
                if any(left <= 0 for left in waits):
                    return
                self._cond.wait(min(waits) if waits else None)

    def _loop(self) -> None:
        while True:
            self._wait_due()
            time.sleep(self.gather_s)  # the rest of the engine step's updates join this write
            with self._cond:
                open_now = list(self._open)
            taken = [(deltas, data) for deltas in open_now if (data := deltas.take_due()) is not None]
            if self.followed is not None and taken:
                taken = self._followed(taken)
            if taken:
                self._write(taken)

    def _followed(self, taken: list[tuple[TextDeltas, JsonObject]]) -> list[tuple[TextDeltas, JsonObject]]:
        """The taken deltas of followed jobs; the others are handed back, held until the next check.
        One check a period asks for the jobs of every open output at once."""
        assert self.followed is not None
        now = self._clock()
        if now - self._checked_at >= self.follow_check_s:
            with self._cond:
                jobs = sorted({d.job_id for d in self._open if d.job_id is not None})
            try:
                self._followed_jobs = self.followed(jobs) if jobs else set()
            except Exception:  # the store may be down: publish as before, the publish reports it
                log.warning("could not tell which jobs are followed", exc_info=True)
                self._followed_jobs = set(jobs)
            self._checked_at = now
        kept: list[tuple[TextDeltas, JsonObject]] = []
        for deltas, data in taken:
            if deltas.job_id is None or deltas.job_id in self._followed_jobs:
                kept.append((deltas, data))
            else:
                deltas.hold(self._checked_at + self.follow_check_s)
                deltas.settle_taken(data, None)  # not published: the text stays pending
        return kept

    def _write(self, taken: list[tuple[TextDeltas, JsonObject]]) -> None:
        """One ``publish_many`` for every delta taken; each output's turn is handed back after it."""
        outcomes: list[str] | None = None
        try:
            outcomes = self.publish_many([(deltas.publish, data) for deltas, data in taken])
            if len(outcomes) != len(taken):
                raise RuntimeError(f"publish_many answered {len(outcomes)} outcomes for {len(taken)} deltas")
        except Exception:  # the store may be down: the text stays pending, tried again
            log.warning("could not publish the text deltas of %d outputs", len(taken), exc_info=True)
            outcomes = None
        finally:
            for k, (deltas, data) in enumerate(taken):
                deltas.settle_taken(data, outcomes[k] if outcomes is not None else None)
        if outcomes is None:
            time.sleep(self.interval_s)


class DeltaReader:
    """A reader's side: the data of ``output.delta`` events -> the new text of one output, in order.

    ``stage=None`` follows the first stage that publishes a delta of ``output``. A later attempt of
    the stage (its worker was lost) publishes its text again from index 0: only what goes beyond
    the text already handed out is new (an AR stage gives the same text again for the same seed)."""

    def __init__(self, stage: str | None = None, output: str = "text") -> None:
        self.stage = stage
        self.output = output
        self.text = ""
        """Everything handed out so far."""
        self._attempt: JsonValue = None
        self._attempt_text = ""

    def feed(self, data: Mapping[str, JsonValue]) -> str:
        """The new text in this delta ('' when it is another output's or repeats what was handed out)."""
        if data.get("output") != self.output:
            return ""
        if self.stage is None:
            self.stage = str(data.get("stage"))
        if data.get("stage") != self.stage:
            return ""
        if data.get("attempt") != self._attempt:
            self._attempt, self._attempt_text = data.get("attempt"), ""
        self._attempt_text += str(data.get("text", ""))
        new = self._attempt_text[len(self.text):]
        self.text += new
        return new
