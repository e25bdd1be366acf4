"""A stage's engine call as a running attempt makes it: through the per-engine batcher or alone,
within the stage's in-flight limit, taking turns between tenants, its progress and previews reported
and its text, a talker's codes or a code2wav's audio streamed as they come.

The call table itself is omni_jobs.engines.stage_exec ((engine, task) -> engine call); this module
adds what an attempt brings to it: its lease, its job's stream and its stop signals (the AR generate
call lives here, with its streamed text).
"""

from __future__ import annotations

import threading

from omni_jobs.core.errors import StageError
from omni_jobs.core.json_types import JsonObject
from omni_jobs.engines.ar import AROutput, TextSoFar
from omni_jobs.engines.batching import BatchDefaults, BatchPolicy, ar_batcher, for_tenant
from omni_jobs.engines.pool import EnginePool
from omni_jobs.engines.stage_exec import (
    ProgressFn,
    StageValues,
    ar_engine_args,
    ar_request,
    code_ids,
    execute_code2wav,
    execute_dit,
    execute_encode,
    execute_recite,
    execute_talk,
    execute_transcribe,
    thinker_handover,
)
from omni_jobs.jobs.ledger import JobLedger, Lease
from omni_jobs.jobs.models import Job, JobEvent
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.params import ARParams, DiTCode2WavParams, StageParams
from omni_jobs.pipelines.spec import StageSpec
from omni_jobs.run.code_stream import codes_text
from omni_jobs.run.speech_stage import JobEnded, run_streamed_code2wav
from omni_jobs.run.stage_attempt import JobCanceled, LeaseLost, Retries, StageLimits
from omni_jobs.run.stage_outputs import StageInputs, StageOutputs
from omni_jobs.run.stage_reports import StageReports

STREAM_READ_MS = 500
"""How long a streamed stage's read of its job's events waits for its upstream's next delta."""


def _execute_ar(engines: EnginePool, stage: StageSpec, params: ARParams, inputs: StageInputs, request_id: str,
                progress: ProgressFn, *, policy: BatchPolicy | None = None,
                on_text: TextSoFar | None = None) -> AROutput:
    """AR generate: the engine's output for this stage's one request."""
    engine = engines.ar(stage.model, ar_engine_args(stage))
    request = ar_request(engines, stage, params, inputs, request_id, on_text=on_text)
    if policy is not None:  # concurrent jobs of this worker share one vLLM batch
        output = ar_batcher(engine, policy).submit(request, progress)
    else:
        (output,) = engine.generate([request], on_progress=lambda _rid, done, total: progress(done, total))
    return output


def _ar_values(output: AROutput) -> StageValues:
    """An AR generate stage's values. The text output carries what the engine reported beside the
    text: why it stopped (vLLM's finish_reason, 'stop' or 'length') and the token usage (OpenAI's ``usage``)."""
    usage: JsonObject = {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": len(output.token_ids)}
    text: JsonObject = {"text": output.text, "finish_reason": output.finish_reason, "usage": usage}
    return {"text": text, "token_ids": output.token_ids}


def token_usage(values: StageValues) -> dict[str, float]:
    """An AR stage's tokens as stage metrics (``prompt_tokens``, ``completion_tokens``): what usage per tenant
    counts (omni_jobs.report.usage). Nothing for a stage whose values carry no usage."""
    text = values.get("text")
    usage = text.get("usage") if isinstance(text, dict) else None
    if not isinstance(usage, dict):
        return {}
    return {name: float(usage[name]) for name in ("prompt_tokens", "completion_tokens")
            if isinstance(usage.get(name), int | float)}


class StageCalls:
    """Makes the engine calls of a process's stage attempts."""

    def __init__(self, engines: EnginePool, catalogue: PipelineCatalogue, ledger: JobLedger, *, reports: StageReports,
                 outputs: StageOutputs, limits: StageLimits, retries: Retries,
                 batching: BatchDefaults | None = None) -> None:
        """``batching``: engine calls go through the per-engine batcher (stage workers); None calls the
        engine per job."""
        self.engines = engines
        self.catalogue = catalogue
        self.ledger = ledger
        self.reports = reports
        self.outputs = outputs
        self.limits = limits
        self.retries = retries
        self.batching = batching
        self._in_flight: dict[tuple[str, str], threading.BoundedSemaphore] = {}
        self._guard = threading.Lock()

    def _in_flight_slot(self, pipeline: str, stage: StageSpec) -> threading.BoundedSemaphore:
        """The per-stage in-flight limit of this process (a stage's batching.max_in_flight)."""
        assert self.batching is not None
        with self._guard:
            key = (pipeline, stage.id)
            if key not in self._in_flight:
                self._in_flight[key] = threading.BoundedSemaphore(self.batching.in_flight(stage))
            return self._in_flight[key]

    def execute(self, stage: StageSpec, job: Job, inputs: StageInputs, lease: Lease, tail: list[JobEvent],
                pipeline: str = "") -> StageValues:
        """The stage's engine call; streamed text still to publish goes into ``tail`` (its events). Its engine
        requests are the job's tenant's: batchers take tenants in turn (omni_jobs.engines.batching)."""
        if self.batching is None:
            return self._execute_now(stage, job, inputs, lease, None, tail)
        with self._in_flight_slot(pipeline or job.pipeline, stage), for_tenant(job.tenant):
            return self._execute_now(stage, job, inputs, lease, self.batching.policy(stage), tail)

    def _execute_now(self, stage: StageSpec, job: Job, inputs: StageInputs, lease: Lease,
                     policy: BatchPolicy | None, tail: list[JobEvent]) -> StageValues:
        params = job.params.get(stage.id, {})
        soft_limit_s, _hard = self.limits.for_stage(stage)
        progress = self.reports.progress_fn(job, stage, lease, soft_limit_s)
        try:
            request_id = f"{job.id}:{stage.id}"
            if stage.engine == "ar" and stage.task_name == "generate":
                return self._execute_streamed_ar(stage, job, ARParams.model_validate(params), inputs, lease, progress,
                                                 policy, tail)
            if stage.engine == "ar" and stage.task_name == "transcribe":
                return execute_transcribe(self.engines, stage, stage.params(params), inputs, request_id, progress,
                                          policy=policy)
            if stage.engine == "ar" and stage.task_name == "recite":
                return execute_recite(self.engines, stage, stage.params(params), inputs, request_id, progress)
            if stage.engine == "ar" and stage.task_name == "talk":
                return self._execute_talk(stage, job, stage.params(params), inputs, lease, progress, policy, tail)
            if stage.stream_source is not None:
                return self._execute_streamed_code2wav(stage, job, stage.params(params), inputs, lease, progress,
                                                       policy)
            if stage.engine == "ar":
                return execute_encode(self.engines, stage, stage.params(params), inputs, request_id, progress)
            if stage.task_name == "code2wav":
                return execute_code2wav(self.engines, stage, stage.params(params), inputs, request_id, progress,
                                        policy=policy)
            return execute_dit(self.engines, stage, stage.params(params), inputs, request_id, progress, policy=policy,
                               preview=self.reports.preview_fn(job, stage, lease))
        except (JobCanceled, StageError):
            raise
        except JobEnded as exc:
            raise JobCanceled(job.id) from exc
        except (ValueError, TypeError, RuntimeError, OSError, KeyError) as exc:
            # Engine-level errors (bad model path, bad shape, too long a prompt) do not pass on retry.
            raise StageError(f"{type(exc).__name__}: {exc}") from exc

    def _execute_streamed_ar(self, stage: StageSpec, job: Job, params: ARParams, inputs: StageInputs, lease: Lease,
                             progress: ProgressFn, policy: BatchPolicy | None, tail: list[JobEvent]) -> StageValues:
        """AR generate whose text goes to the job's stream as it comes (``output.delta`` events);
        the rest goes into ``tail``, written with the stage's result."""
        deltas = self.reports.open_text(stage, job, lease) if "text" in stage.outputs else None
        try:
            output = _execute_ar(self.engines, stage, params, inputs, f"{job.id}:{stage.id}", progress,
                                 policy=policy, on_text=deltas.update if deltas is not None else None)
            if deltas is not None:
                self.reports.finish_text(deltas, output.text, job, tail)
            handover = thinker_handover(self.engines, stage, params, inputs, f"{job.id}:{stage.id}", output)
            return {**_ar_values(output), **handover}
        finally:
            if deltas is not None:
                self.reports.discard(deltas)

    def _execute_talk(self, stage: StageSpec, job: Job, params: StageParams, inputs: StageInputs, lease: Lease,
                      progress: ProgressFn, policy: BatchPolicy | None, tail: list[JobEvent]) -> StageValues:
        """A talker; where a stage downstream reads its codes while they are written (a streamed code2wav), they go
        to the job's stream as they come (``output.delta`` of ``audio_codes``; omni_jobs.run.code_stream), whether or
        not a client follows the job: that stage does."""
        streamed = "audio_codes" in self.catalogue.get(job.pipeline).streamed_outputs(stage.id)
        deltas = self.reports.open_codes(stage, job, lease) if streamed else None
        try:
            values = execute_talk(self.engines, stage, params, inputs, f"{job.id}:{stage.id}", progress, policy=policy,
                                  on_codes=(lambda codes: deltas.update(codes_text(codes))) if deltas else None)
            if deltas is not None:
                codes = code_ids(values["audio_codes"], "audio_codes")
                self.reports.finish_text(deltas, codes_text([int(c) for c in codes.tolist()]), job, tail)
            return values
        finally:
            if deltas is not None:
                self.reports.discard(deltas)

    def _execute_streamed_code2wav(self, stage: StageSpec, job: Job, params: StageParams, inputs: StageInputs,
                                   lease: Lease, progress: ProgressFn, policy: BatchPolicy | None) -> StageValues:
        """A code2wav that runs beside its talker (omni_jobs.run.speech_stage), its audio deltas published under this
        attempt's lease."""
        assert isinstance(params, DiTCode2WavParams)
        source = stage.stream_source
        assert source is not None
        target = self.reports.delta_target(job, lease)
        where = f"job {job.id} stage {stage.id}"
        patiently = self.retries.patiently

        def publish(data: JsonObject) -> None:
            outcome = patiently(lambda: target(data), where)
            if outcome == "lost":
                raise LeaseLost(job.id)
            if outcome != "ok":
                raise JobCanceled(job.id)

        def recorded_codes() -> object:
            current = patiently(lambda: self.ledger.get(job.id), where)
            if current is None:
                raise JobCanceled(job.id)
            return self.outputs.load_input(self.catalogue.get(job.pipeline), source, current)

        return run_streamed_code2wav(
            self.engines, stage, job.id, params, inputs, lease.attempt,
            read=lambda after: patiently(
                lambda: self.ledger.events(job.id, after=after, block_ms=STREAM_READ_MS), where),
            recorded_codes=recorded_codes, publish=publish, progress=progress,
            expected_codes=int(str(job.params.get(source.source, {}).get("max_tokens", 0) or 0)), policy=policy)
