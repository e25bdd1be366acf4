"""Run one stage of one job: load its inputs, call its engine, store its outputs, say what is next.

This is the whole of a stage worker's logic; the Celery task around it only adds transport. It is
idempotent under redelivery: a job that is finished or canceled is not touched, and a stage whose
outputs already exist is not run again, only advanced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omni_jobs import keys
from omni_jobs.artifacts import ArtifactRef, ArtifactStore
from omni_jobs.dispatch import RESULTS_QUEUE, NextStep
from omni_jobs.engines.ar import ARRequest, SamplingOptions
from omni_jobs.engines.cache import EngineCache
from omni_jobs.engines.dit import DiTRequest
from omni_jobs.errors import StageError
from omni_jobs.jobs import state
from omni_jobs.jobs.models import Job, JobError, JobEvent, JobStatus, StageStatus, now
from omni_jobs.jobs.store import JobStore
from omni_jobs.payloads import FORMATS, decode_payload, encode_payload
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.params import ARParams, DiTParams
from omni_jobs.pipelines.spec import INPUT_SOURCE, PipelineSpec, StageSpec

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]


class JobCanceled(Exception):
    """Raised inside an engine callback to stop work for a job that was canceled meanwhile."""


@dataclass(frozen=True)
class StageOutcome:
    """What one run of a stage did, and what became runnable because of it."""

    status: str  # "succeeded" | "skipped" | "failed" | "canceled"
    next_steps: list[NextStep]


def _execute_ar(engines: EngineCache, stage: StageSpec, params: ARParams, inputs: dict[str, Any], request_id: str,
                progress: ProgressFn) -> dict[str, Any]:
    engine = engines.ar(stage.model, stage.engine_args)
    sampling = SamplingOptions(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, seed=params.seed
    )
    prompt = params.prompt_template.format(prompt=inputs["prompt"])
    (output,) = engine.generate([ARRequest(request_id=request_id, prompt=prompt, sampling=sampling)])
    progress(len(output.token_ids), params.max_tokens)
    return {"text": output.text, "token_ids": output.token_ids}


def _execute_dit(engines: EngineCache, stage: StageSpec, params: DiTParams, inputs: dict[str, Any], request_id: str,
                 progress: ProgressFn) -> dict[str, Any]:
    engine = engines.dit(stage.model, stage.engine_args)
    request = DiTRequest(
        request_id=request_id,
        prompt=inputs["prompt"],
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        seed=params.seed,
        negative_prompt=params.negative_prompt,
    )
    (output,) = engine.generate([request], on_step=progress)
    return {"image": output.image}


def _mark_queued(stage_id: str) -> Callable[[Job], list[JobEvent]]:
    def mutate(job: Job) -> list[JobEvent]:
        if job.stage_record(stage_id).status is StageStatus.pending:
            return state.stage_queued(job, stage_id, now())
        return []

    return mutate


class StageRunner:
    """Runs stages for any pipeline in the catalogue, with engines loaded once per process."""

    def __init__(self, *, store: JobStore, catalogue: PipelineCatalogue, artifacts: ArtifactStore,
                 engines: EngineCache) -> None:
        self.store = store
        self.catalogue = catalogue
        self.artifacts = artifacts
        self.engines = engines

    def run(self, job_id: str, stage_id: str, *, worker: str) -> StageOutcome:
        job = self.store.get(job_id)
        if job is None:
            log.warning("job %s is gone (expired or deleted); dropping stage %s", job_id, stage_id)
            return StageOutcome("skipped", [])
        if job.status.is_final:
            log.info("job %s is %s; not running stage %s", job_id, job.status.value, stage_id)
            return StageOutcome("skipped", [])
        spec = self.catalogue.get(job.pipeline)
        stage = spec.stage(stage_id)
        record = job.stage_record(stage_id)
        if record.status is StageStatus.succeeded and all(self.artifacts.exists(r) for r in record.outputs.values()):
            log.info("job %s stage %s already succeeded; advancing only", job_id, stage_id)
            return StageOutcome("skipped", self._next_steps(spec, self.store.require(job_id), stage_id))

        self.store.update(job_id, lambda j: state.stage_started(j, stage_id, worker, now()))
        started = time.perf_counter()
        try:
            inputs = self._load_inputs(spec, stage, job)
            values = self._execute(stage, job, inputs)
            engine_s = time.perf_counter() - started
            refs = self._store_outputs(job_id, stage, values)
        except JobCanceled:
            log.info("job %s was canceled during stage %s", job_id, stage_id)
            return StageOutcome("canceled", [])
        except StageError as exc:
            self.fail(job_id, stage_id, exc)
            return StageOutcome("failed", [])
        metrics = {"run_s": time.perf_counter() - started, "engine_s": engine_s}
        job, _ = self.store.update(job_id, lambda j: state.stage_succeeded(j, stage_id, refs, metrics, now()))
        return StageOutcome("succeeded", self._next_steps(spec, job, stage_id))

    def fail(self, job_id: str, stage_id: str | None, exc: BaseException) -> None:
        """End the job failed with the stage and reason recorded (unless it already ended)."""
        error = JobError(stage=stage_id, type=type(exc).__name__, message=str(exc) or repr(exc))

        def mutate(job: Job) -> list[JobEvent]:
            if job.status.is_final:
                return []
            return state.job_failed(job, error, now())

        self.store.update(job_id, mutate)
        log.error("job %s failed in stage %s: %s", job_id, stage_id, error.message)

    # --- steps of run() ---
    def _load_inputs(self, spec: PipelineSpec, stage: StageSpec, job: Job) -> dict[str, Any]:
        inputs: dict[str, Any] = {}
        for port, binding in stage.inputs.items():
            if binding.source == INPUT_SOURCE:
                inputs[port] = job.input[binding.port]
                continue
            upstream = spec.stage(binding.source)
            ref = job.stage_record(binding.source).outputs.get(binding.port)
            if ref is None:
                raise StageError(f"stage '{binding.source}' recorded no output '{binding.port}'")
            inputs[port] = decode_payload(upstream.outputs[binding.port], self.artifacts.get(ref))
        return inputs

    def _execute(self, stage: StageSpec, job: Job, inputs: dict[str, Any]) -> dict[str, Any]:
        params = job.params.get(stage.id, {})
        progress = self._progress_reporter(job.id, stage)
        try:
            if stage.engine == "ar":
                return _execute_ar(self.engines, stage, ARParams(**params), inputs, f"{job.id}:{stage.id}", progress)
            return _execute_dit(self.engines, stage, DiTParams(**params), inputs, f"{job.id}:{stage.id}", progress)
        except (JobCanceled, StageError):
            raise
        except (ValueError, TypeError, RuntimeError, OSError, KeyError) as exc:
            # Engine-level errors (bad model path, bad shape, too long a prompt) do not pass on retry.
            raise StageError(f"{type(exc).__name__}: {exc}") from exc

    def _progress_reporter(self, job_id: str, stage: StageSpec) -> ProgressFn:
        unit = "tokens" if stage.engine == "ar" else "steps"

        def report(step: int, total: int) -> None:
            def mutate(job: Job) -> list[JobEvent]:
                if job.status is JobStatus.canceled:
                    raise JobCanceled(job_id)
                return state.stage_progress(job, stage.id, step, total, unit, now())

            self.store.update(job_id, mutate)

        return report

    def _store_outputs(self, job_id: str, stage: StageSpec, values: dict[str, Any]) -> dict[str, ArtifactRef]:
        refs: dict[str, ArtifactRef] = {}
        for port, modality in stage.outputs.items():
            fmt = FORMATS[modality]
            key = keys.intermediate_artifact(job_id, stage.id, f"{port}.{fmt.extension}")
            refs[port] = self.artifacts.put_intermediate(key, encode_payload(modality, values[port]), fmt.media_type)
        return refs

    def _next_steps(self, spec: PipelineSpec, job: Job, stage_id: str) -> list[NextStep]:
        """Downstream stages whose inputs are now all ready, or the results step when all are done."""
        done = {r.id for r in job.stages if r.status is StageStatus.succeeded}
        steps: list[NextStep] = []
        for downstream in spec.downstream(stage_id):
            if downstream.upstream() <= done and self.store.claim_enqueue(job.id, downstream.id):
                self.store.update(job.id, _mark_queued(downstream.id))
                steps.append(NextStep(job.id, downstream.id, downstream.queue_name))
        if done == {s.id for s in spec.stages} and self.store.claim_enqueue(job.id, "__results__"):
            steps.append(NextStep(job.id, None, RESULTS_QUEUE))
        return steps
