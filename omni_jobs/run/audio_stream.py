"""Speech as it is made, as ``output.delta`` events of a job: the wire form of an audio chunk, and a reader's side.

A streaming stage (Qwen2.5-Omni's code2wav, fed the talker's codes while the talker writes them) publishes each
chunk of audio the moment it is final, as one ``output.delta`` event::

    {"stage": "code2wav", "output": "audio", "attempt": 1, "index": 0, "source_attempt": 1,
     "format": "pcm_s16le", "sample_rate": 24000, "channels": 1, "start": 0, "samples": 11520,
     "data": "<base64 of 16-bit little-endian PCM>"}

``start`` is the chunk's first sample in the clip. The chunks of one (attempt, source_attempt), joined in
``index`` order, are the clip the stage stores as its ``audio`` output (the same samples, as a WAV).

A stage that runs again (its worker was lost, or its talker's was) publishes its audio again from sample 0,
under a new ``attempt`` or ``source_attempt``. The reader's rule is the text deltas' (omni_jobs.run.text_stream): only
the samples beyond those already handed out are new. Talker and code2wav sample from fixed seeds, so a rerun makes
the same audio and a listener hears one clip, without a repeat or a gap.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omni_jobs.core.json_types import JsonObject, JsonValue

if TYPE_CHECKING:  # numpy only where samples are encoded: a reader (omni_jobs.client's stream_audio) needs none
    import numpy as np

PCM_FORMAT = "pcm_s16le"
"""The sample format of every audio delta: 16-bit signed little-endian PCM, what browsers and OpenAI's clients
take as ``pcm16``."""


def pcm16(samples: np.ndarray) -> bytes:
    """Float samples in [-1, 1] (clipped) as 16-bit little-endian PCM bytes, rounded as the stored WAV's are
    (omni_jobs.artifacts.codecs.encode_wav), so that the streamed samples are the stored ones."""
    import numpy as np

    clipped = np.clip(np.asarray(samples, dtype=np.float64).reshape(-1), -1.0, 1.0)
    return np.round(clipped * 32767.0).astype("<i2").tobytes()


def audio_delta(*, stage: str, output: str, attempt: int, index: int, source_attempt: int | None, start: int,
                samples: np.ndarray, sample_rate: int) -> JsonObject:
    """One chunk's ``output.delta`` data (mono)."""
    data = pcm16(samples)
    return {"stage": stage, "output": output, "attempt": attempt, "index": index, "source_attempt": source_attempt,
            "format": PCM_FORMAT, "sample_rate": sample_rate, "channels": 1, "start": start,
            "samples": len(data) // 2, "data": base64.b64encode(data).decode("ascii")}


def is_audio_delta(data: Mapping[str, JsonValue]) -> bool:
    return data.get("format") == PCM_FORMAT and isinstance(data.get("data"), str)


@dataclass(frozen=True)
class AudioChunk:
    """New audio for a listener: PCM bytes (16-bit, little-endian, mono) at ``sample_rate``."""

    pcm: bytes
    sample_rate: int
    start: int
    """Its first sample in the clip."""

    @property
    def samples(self) -> int:
        return len(self.pcm) // 2


class AudioDeltaReader:
    """The data of ``output.delta`` events -> the new audio of one output, in order, each sample once.

    ``stage=None`` follows the first stage that publishes audio under ``output``."""

    def __init__(self, stage: str | None = None, output: str = "audio") -> None:
        self.stage = stage
        self.output = output
        self.handed_out = 0
        """Samples handed out so far."""
        self.sample_rate: int | None = None

    def feed(self, data: Mapping[str, JsonValue]) -> AudioChunk | None:
        """The new audio in this delta (None when it is another output's, or repeats what was handed out)."""
        if data.get("output") != self.output or not is_audio_delta(data):
            return None
        if self.stage is None:
            self.stage = str(data.get("stage"))
        if data.get("stage") != self.stage:
            return None
        start, rate, encoded = data.get("start"), data.get("sample_rate"), data.get("data")
        if not isinstance(start, int) or not isinstance(rate, int) or not isinstance(encoded, str):
            return None
        pcm = base64.b64decode(encoded)
        end = start + len(pcm) // 2
        if end <= self.handed_out:  # a repeat of what was handed out
            return None
        # a gap (start beyond what was handed out: a delta the stream trimmed away) is skipped over, not waited for
        fresh = pcm[max(0, self.handed_out - start) * 2:]
        chunk = AudioChunk(pcm=fresh, sample_rate=rate, start=max(start, self.handed_out))
        self.handed_out = end
        self.sample_rate = rate
        return chunk
