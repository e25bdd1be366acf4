"""Speech codes handed from a talker to code2wav while the talker writes them, and code2wav's audio streamed out.

The talker stage publishes its codes as ``output.delta`` events of its ``audio_codes`` output, through the text
delta writer (omni_jobs.run.text_stream: at most one write per 100 ms, the last one with the stage's result): the codes
are written as text, each followed by a comma, under the key ``codes``::

    {"stage": "talker", "output": "audio_codes", "codes": "812,33,4051,", "index": 3, "attempt": 1}

The code2wav stage, queued as soon as the talker starts (its ``stream_input``), reads the job's event stream and
renders the codes in chunks as they come (``SpeechStreamer``), each chunk out at once as an audio delta
(omni_jobs.run.audio_stream). When the talker's result is recorded, its stored codes are the truth: if they are the
codes streamed (one talker attempt, no delta missed), the rest of the clip is rendered; if not (the talker ran
again, or deltas were trimmed from the stream), the clip is rendered again from them, from sample 0, and readers
hand out only what is new. The stage's ``audio`` output is the joined chunks of its last rendering: what was heard
is what is stored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from omni_jobs.core.json_types import JsonObject, JsonValue
from omni_jobs.media.payloads import AudioClip
from omni_jobs.run.audio_stream import audio_delta

if TYPE_CHECKING:
    from omni_jobs.engines.code2wav import Code2WavStream

CODES_DELTA_INTERVAL_S = 0.1
"""The least time between two codes deltas of a talker: code2wav renders 12 codes first, then 24 (0.48 s of speech),
so finer deltas would only fill the job's stream (it keeps its last ~2000 events)."""

CODES_FIELD = "codes"
"""The key of a codes delta's new codes (text: each code followed by a comma)."""


def codes_text(codes: Sequence[int]) -> str:
    """Codes as the text their deltas carry: it only grows as codes are added, as streamed text must."""
    return "".join(f"{int(c)}," for c in codes)


def parse_codes(text: str) -> list[int]:
    """The codes of a delta's text (ValueError on anything but digits and commas)."""
    return [int(part) for part in text.split(",") if part]


class CodesFollower:
    """A talker's codes from its ``output.delta`` events, attempt by attempt: the codes of the newest attempt
    seen, and whether every delta of it was seen (indexes 0, 1, 2... without a gap)."""

    def __init__(self, stage: str, output: str) -> None:
        self.stage = stage
        self.output = output
        self.attempt: JsonValue = None
        self.codes: list[int] = []
        self.whole = True
        """False once a delta of this attempt was missed: its codes are then known only from the stored result."""
        self._next_index = 0

    def feed(self, data: Mapping[str, JsonValue]) -> tuple[bool, list[int]]:
        """(restarted: a new attempt began, new codes of the current attempt) for one delta's data."""
        if data.get("stage") != self.stage or data.get("output") != self.output:
            return False, []
        text, index = data.get(CODES_FIELD), data.get("index")
        if not isinstance(text, str) or not isinstance(index, int):
            return False, []
        restarted = data.get("attempt") != self.attempt
        if restarted:
            self.attempt, self.codes, self.whole, self._next_index = data.get("attempt"), [], True, 0
        if index != self._next_index:
            self.whole = False
        self._next_index = index + 1
        if not self.whole:
            return restarted, []
        new = parse_codes(text)
        self.codes.extend(new)
        return restarted, new


class SpeechStreamer:
    """code2wav's side of a streamed clip: codes in as they come, each chunk of audio out as a delta at once.

    ``make_stream`` starts a fresh renderer (a Code2WavStream in the stage's voice and seed); ``publish`` sends one
    audio delta's data (it raises to stop the stage: its job was canceled or its lease lost)."""

    def __init__(self, make_stream: Callable[[], Code2WavStream], publish: Callable[[JsonObject], None], *,
                 stage: str, output: str, attempt: int, sample_rate: int) -> None:
        self._make_stream = make_stream
        self._publish = publish
        self.stage = stage
        self.output = output
        self.attempt = attempt
        self.sample_rate = sample_rate
        self.source_attempt: int | None = None
        self._stream = make_stream()
        self._pieces: list[np.ndarray] = []
        self._index = 0
        self.renderings = 1
        """How many times the clip was begun (more than 1: the talker ran again, or a delta was missed)."""

    @property
    def samples(self) -> int:
        return sum(len(p) for p in self._pieces)

    @property
    def codes(self) -> list[int]:
        return self._stream.codes

    def restart(self, source_attempt: int | None) -> None:
        """Render again from sample 0 (the talker's attempt ``source_attempt`` writes other codes)."""
        if self._stream.codes or self._pieces:
            self._stream = self._make_stream()
            self._pieces = []
            self.renderings += 1
        self.source_attempt = source_attempt

    def push(self, codes: Sequence[int]) -> None:
        if codes:
            self._send(self._stream.push(codes))

    def finish(self, final_codes: Sequence[int]) -> AudioClip:
        """The talker's recorded codes: the rest of the clip (or all of it again, if they are not the codes
        streamed); the whole clip, as its deltas joined give it."""
        streamed = self._stream.codes
        if list(final_codes[:len(streamed)]) != streamed:
            self.restart(self.source_attempt)
            streamed = []
        self.push(list(final_codes[len(streamed):]))
        self._send(self._stream.finish())
        samples = np.concatenate(self._pieces) if self._pieces else np.zeros(0, dtype=np.float32)
        return AudioClip(samples=samples.astype(np.float32).reshape(1, -1), sample_rate=self.sample_rate)

    def _send(self, clip: AudioClip | None) -> None:
        if clip is None or clip.samples.size == 0:
            return
        samples = np.asarray(clip.samples, dtype=np.float32).reshape(-1)
        self._publish(audio_delta(stage=self.stage, output=self.output, attempt=self.attempt, index=self._index,
                                  source_attempt=self.source_attempt, start=self.samples, samples=samples,
                                  sample_rate=self.sample_rate))
        self._pieces.append(samples)
        self._index += 1
