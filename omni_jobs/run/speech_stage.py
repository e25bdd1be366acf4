"""A code2wav stage that streams: it runs beside its talker, reading the talker's codes from the job's event stream
as they are written, and publishes the speech chunk by chunk (omni_jobs.run.code_stream says the protocol).

The stage runner (omni_jobs.run.stages) hands it the job's ledger and two callbacks that stop the attempt the runner's
way: ``publish`` (an audio delta, under the attempt's lease) and ``progress`` (where a lost lease or a cancel is
noticed). Everything it reads is in Redis, so an attempt that runs again (its worker died) reads the same codes
from the start of the stream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from omni_jobs.core.json_types import JsonObject
from omni_jobs.engines.batching import BatchPolicy
from omni_jobs.engines.code2wav import Code2WavStream, code2wav_batcher
from omni_jobs.engines.pool import EnginePool
from omni_jobs.engines.stage_exec import ProgressFn, StageValues, code_ids, speaker_of
from omni_jobs.jobs.models import FINAL_EVENTS, EventType, JobEvent
from omni_jobs.pipelines.params import DiTCode2WavParams
from omni_jobs.pipelines.spec import StageSpec
from omni_jobs.run.code_stream import CodesFollower, SpeechStreamer


class JobEnded(Exception):
    """The job ended (failed or canceled) while the stage waited for its talker."""


def run_streamed_code2wav(engines: EnginePool, stage: StageSpec, job_id: str, params: DiTCode2WavParams,
                          inputs: Mapping[str, object], attempt: int, *, read: Callable[[str], Sequence[JobEvent]],
                          recorded_codes: Callable[[], object], publish: Callable[[JsonObject], None],
                          progress: ProgressFn, expected_codes: int = 0,
                          policy: BatchPolicy | None = None) -> StageValues:
    """Render the talker's codes as they come; the whole clip once the talker's result is recorded.

    ``read(cursor)``: the job's events after ``cursor`` (waiting a little for new ones); ``recorded_codes()``: the
    talker's stored ``audio_codes`` once it succeeded; ``publish``: one audio delta (raises to stop the attempt);
    ``expected_codes``: the most the talker may write (its max_tokens), the progress's total; ``policy``: the
    chunks go through the engine's batcher, so that concurrent streams' chunks of one length share a DiT batch
    (a stream's first chunk at 16 concurrent jobs waited behind 15 others' rendered one by one)."""
    source = stage.stream_source
    assert source is not None, "a streamed code2wav stage has a stream_input"
    engine = engines.code2wav(stage.model, stage.engine_args)
    voice = speaker_of(stage, inputs, params.speaker)

    render = code2wav_batcher(engine, policy).submit if policy is not None else None

    def fresh() -> Code2WavStream:
        return Code2WavStream(engine, voice, seed=params.seed, num_steps=params.num_inference_steps,
                              guidance_scale=params.guidance_scale, render=render, request_id=f"{job_id}:{stage.id}")

    streamer = SpeechStreamer(fresh, publish, stage=stage.id, output="audio", attempt=attempt,
                              sample_rate=engine.sample_rate)
    follower = CodesFollower(source.source, source.port)
    cursor, talker_done = "0-0", False
    progress(0, 1)
    while not talker_done:
        for event in read(cursor):
            cursor = event.id
            if event.type == EventType.output_delta:
                restarted, new = follower.feed(event.data)
                if restarted:
                    streamer.restart(follower.attempt if isinstance(follower.attempt, int) else None)
                if follower.whole:
                    streamer.push(new)
            elif event.type == EventType.stage_succeeded and event.data.get("stage") == source.source:
                talker_done = True
            elif event.type in FINAL_EVENTS:
                raise JobEnded(f"job {job_id} ended ({event.type}) before its talker's codes were all rendered")
        # codes rendered of those expected: never all of them until the end (a finished count is always written)
        progress(len(streamer.codes), max(expected_codes, len(follower.codes)) + 1)
    clip = streamer.finish([int(c) for c in code_ids(recorded_codes(), source.port).tolist()])
    progress(1, 1)
    return {"audio": clip}
