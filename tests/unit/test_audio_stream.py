"""Audio deltas: the wire form round-trips, and a reader hands out each sample once, in order, across a rerun."""

from __future__ import annotations

import numpy as np

from omni_jobs.run.audio_stream import AudioDeltaReader, audio_delta, pcm16


def _delta(start: int, samples: np.ndarray, *, attempt: int = 1, index: int = 0) -> dict:
    return audio_delta(stage="code2wav", output="audio", attempt=attempt, index=index, source_attempt=1,
                       start=start, samples=samples, sample_rate=24000)


def test_joined_chunks_are_the_clip_and_a_rerun_adds_only_what_is_new() -> None:
    clip = np.sin(np.linspace(0, 40, 3000)).astype(np.float32) * 0.5
    reader = AudioDeltaReader()
    got = [reader.feed(_delta(0, clip[:1000])), reader.feed(_delta(1000, clip[1000:1800], index=1))]
    # the stage runs again: the same audio from sample 0; the first 1800 samples were heard already
    got += [reader.feed(_delta(0, clip[:1200], attempt=2)), reader.feed(_delta(1200, clip[1200:], attempt=2, index=1))]
    assert got[2] is None
    pcm = b"".join(c.pcm for c in got if c is not None)
    assert pcm == pcm16(clip) and reader.handed_out == 3000
    assert [c.start for c in got if c is not None] == [0, 1000, 1800]


def test_other_outputs_and_text_deltas_are_not_audio() -> None:
    reader = AudioDeltaReader()
    assert reader.feed({"stage": "thinker", "output": "text", "text": "hi", "index": 0, "attempt": 1}) is None
    assert reader.feed({**_delta(0, np.zeros(10, np.float32)), "output": "other"}) is None
    assert reader.feed(_delta(0, np.zeros(10, np.float32))) is not None
