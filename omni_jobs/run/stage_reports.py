"""What a running stage tells its job's readers: progress at its steps and tokens, a DiT stage's
previews, its text (and a talker's codes) as ``output.delta`` events; and, at each step, whether it
must stop (canceled, its lease lost, its deadline or soft time limit passed).

Reports are written beside the engine, never inline with a batched engine's thread, often while a
reader looks at the job and seldom while nobody does (omni_jobs.jobs.followed). Split from the stage
runner (omni_jobs.run.stages) so that these rates and streams read apart from the attempt's lease
(omni_jobs.run.stage_attempt) and its stored outputs (omni_jobs.run.stage_outputs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from omni_jobs.core.json_types import JsonObject
from omni_jobs.engines.stage_exec import ProgressFn
from omni_jobs.jobs.followed import Ask, FollowedJobs
from omni_jobs.jobs.ledger import JobLedger, Lease
from omni_jobs.jobs.models import EventType, Job, JobEvent, now
from omni_jobs.media.payloads import decode_payload
from omni_jobs.media.previews import LatentPreview
from omni_jobs.pipelines.spec import StageSpec
from omni_jobs.run.code_stream import CODES_DELTA_INTERVAL_S, CODES_FIELD
from omni_jobs.run.progress_writer import ProgressWriter
from omni_jobs.run.stage_attempt import DeadlineExceeded, JobCanceled, LeaseLost, StageTimeout
from omni_jobs.run.stage_cache import CachedOutputs
from omni_jobs.run.text_stream import DELTA_INTERVAL_S, Publish, TextDeltas, TextStreams, publish_each


@dataclass(frozen=True)
class Reporting:
    """How often a running stage reports. Progress: every ``progress_interval_s`` while its job is
    followed or looked at, else every ``progress_unfollowed_interval_s``. Text: at least
    ``text_delta_interval_s`` between two ``output.delta`` writes of one output (the last delta goes
    with the stage's result); with ``text_deltas`` 'followed', they go out only while a stream follows
    the job, and the rest with the stage's result (TextStreams). ``followed``: asks who reads which
    jobs now (omni_jobs.jobs.followed); None: every job counts as followed."""

    progress_interval_s: float = 0.2
    progress_unfollowed_interval_s: float = 1.0
    text_delta_interval_s: float = DELTA_INTERVAL_S
    text_deltas: Literal["followed", "always"] = "followed"
    followed: Ask | None = None


@dataclass(frozen=True, eq=False)
class _DeltaTarget:
    """Where one running stage's text deltas go (its job's stream, under its lease): a ``Publish``
    that the text writer can also hand to ``JobLedger.publish_many`` with others."""

    ledger: JobLedger
    lease: Lease
    job: Job

    def __call__(self, data: JsonObject) -> str:
        return self.ledger.publish(self.lease, self.job, EventType.output_delta, data)


class StageReports:
    """The progress, previews and deltas of a process's running stages, and their stop signals."""

    def __init__(self, ledger: JobLedger, reporting: Reporting, *, background: bool) -> None:
        """``background``: progress and deltas are written from a thread of their own, never inline
        (batched engines report for many jobs from one thread)."""
        self.ledger = ledger
        self.reporting = reporting
        self.progress = ProgressWriter(ledger, background=background)
        self.followed = FollowedJobs(reporting.followed)
        self.text_streams = TextStreams(background=background, publish_many=self._publish_deltas,
                                        interval_s=reporting.text_delta_interval_s,
                                        followed=self.followed.followed_among
                                        if reporting.text_deltas == "followed" else None)

    @contextmanager
    def attending(self, job: Job, lease: Lease) -> Iterator[None]:
        """The attempt's reports start (and its job is asked after, who follows it) and end with the body."""
        self.progress.begin(lease)
        self.followed.track(job.id)
        try:
            yield
        finally:
            self.followed.untrack(job.id)
            self.progress.finish(lease)

    def stop(self, lease: Lease, why: str) -> None:
        """Stop the attempt at its next step or token (``why``: 'lost', ...)."""
        self.progress.stop(lease, why)

    def drain(self, lease: Lease) -> None:
        """The attempt's reports still queued are written (its last preview before its result)."""
        self.progress.drain(lease)

    def progress_fn(self, job: Job, stage: StageSpec, lease: Lease, soft_limit_s: float) -> ProgressFn:
        """Called by the engine at every step/token: records progress and is where a running stage
        notices that its job was canceled, its lease lost, its deadline passed, or that it ran past
        ``soft_limit_s``.

        While a reader looks at the job, progress is written often, its first and last step always.
        While nobody does, it is written seldom, counted from the first step: a stage shorter than
        that writes none (its start and its end are events of their own, and the end clears the
        job's progress). Those two writes were a commit each for every job of a batch, beside the
        engine: without them a DiT 32px small job runs 4.4 scripts in Redis instead of 6.7
        (docs/decisions/progress-nobody-reads.md)."""
        unit = "tokens" if stage.engine == "ar" else "steps"
        often, seldom = self.reporting.progress_interval_s, self.reporting.progress_unfollowed_interval_s
        started = time.monotonic()
        last_write = float("-inf")
        first_step_at: float | None = None

        def check() -> None:
            why = self.progress.stopped(lease)
            if why == "lost":
                raise LeaseLost(job.id)
            if why is not None:
                raise JobCanceled(job.id)

        def report(step: int, total: int) -> None:
            nonlocal last_write, first_step_at
            at = time.monotonic()
            elapsed = at - started
            if elapsed > soft_limit_s:
                raise StageTimeout(
                    f"stage '{stage.id}' ran {elapsed:.1f}s, past its soft time limit of {soft_limit_s:g}s "
                    f"(set soft_time_limit_s on the stage or OMNI_STAGE_SOFT_TIME_LIMIT_S)"
                )
            if job.deadline_at is not None and now() > job.deadline_at:
                raise DeadlineExceeded(job.id)
            check()
            if first_step_at is None:
                first_step_at = at
            if self.followed.watched(job.id):
                if step < total and at - last_write < often:
                    return
            elif at - max(last_write, first_step_at) < seldom:
                return
            last_write = at
            self.progress.report(lease, job, step, total, unit)
            check()  # an inline write may have just found it

        return report

    def preview_fn(self, job: Job, stage: StageSpec, lease: Lease) -> Callable[[LatentPreview], None]:
        """Where a DiT stage's previews go: the progress writer encodes and publishes them off the
        engine's thread (a refused publish stops the stage at its next step, as progress does)."""

        def publish(preview: LatentPreview) -> None:
            self.progress.preview(lease, job, lambda: preview.event_data(stage.id))

        return publish

    def delta_target(self, job: Job, lease: Lease) -> Publish:
        """Publishes one delta of this attempt's on its job's stream, under its lease."""
        return _DeltaTarget(self.ledger, lease, job)

    def open_text(self, stage: StageSpec, job: Job, lease: Lease) -> TextDeltas:
        """The stage's text, to be streamed as it comes (while a reader follows the job, per ``text_deltas``)."""
        return self.text_streams.open(stage.id, "text", self.delta_target(job, lease), attempt=lease.attempt,
                                      on_stop=lambda why: self.progress.stop(lease, why), job_id=job.id)

    def open_codes(self, stage: StageSpec, job: Job, lease: Lease) -> TextDeltas:
        """A talker's codes, streamed as they come whether or not a client follows the job: a code2wav
        stage downstream does (omni_jobs.run.code_stream)."""
        return self.text_streams.open(stage.id, "audio_codes", self.delta_target(job, lease),
                                      attempt=lease.attempt, on_stop=lambda why: self.progress.stop(lease, why),
                                      field=CODES_FIELD, interval_s=CODES_DELTA_INTERVAL_S)

    def finish_text(self, deltas: TextDeltas, text: str, job: Job, tail: list[JobEvent]) -> None:
        """The rest of a streamed text becomes the last delta, in ``tail``; a refused publish
        on the way (canceled, lease lost) stops the stage."""
        why, data = self.text_streams.finish(deltas, text)
        if why == "lost":
            raise LeaseLost(job.id)
        if why != "ok":
            raise JobCanceled(job.id)
        if data is not None:
            tail.append(JobEvent(job_id=job.id, type=EventType.output_delta, at=now(), data=data))

    def discard(self, deltas: TextDeltas) -> None:
        """A stream opened for the attempt, closed whatever became of it."""
        self.text_streams.discard(deltas)

    def stream_cached_text(self, stage: StageSpec, job: Job, lease: Lease, hit: CachedOutputs,
                           tail: list[JobEvent]) -> None:
        """A cached AR text still reaches the job's stream: as one delta, so that a streaming reader
        sees the same text whether the engine ran or not."""
        if stage.engine == "ar" and stage.task_name == "generate" and "text" in stage.outputs:
            self.finish_text(self.open_text(stage, job, lease), decode_payload("text", hit.data["text"]), job, tail)

    def _publish_deltas(self, items: Sequence[tuple[Publish, JsonObject]]) -> list[str]:
        """The text writer's ``PublishMany``: the deltas of all running stages due together, in one
        round trip (``JobLedger.publish_many``)."""
        writes = [(p.lease, p.job, EventType.output_delta, data) for p, data in items if isinstance(p, _DeltaTarget)]
        if len(writes) < len(items):  # some other Publish: each on its own
            return publish_each(items)
        return self.ledger.publish_many(writes)
