"""Run one stage of one job: load its inputs, call its engine, store its outputs, say what is next.

This is the whole of a stage worker's logic; the Celery task around it only adds transport. It is
idempotent under redelivery: a job that is finished or canceled is not touched, and a stage whose
outputs already exist is not run again, only advanced.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from omni_jobs import keys
from omni_jobs.artifacts import ArtifactRef, ArtifactStore
from omni_jobs.batching import BatchDefaults, BatchPolicy, ar_batcher
from omni_jobs.dispatch import RESULTS_QUEUE, NextStep
from omni_jobs.engines.ar import ARRequest, SamplingOptions
from omni_jobs.engines.cache import EngineCache
from omni_jobs.engines.stage_exec import execute_dit, execute_encode
from omni_jobs.errors import StageError
from omni_jobs.input_files import load_input_image
from omni_jobs.jobs import state
from omni_jobs.jobs.models import Job, JobError, JobEvent, StageStatus, now
from omni_jobs.jobs.store import JobStore
from omni_jobs.payloads import FORMATS, decode_payload, encode_payload
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.params import ARParams
from omni_jobs.pipelines.spec import INPUT_SOURCE, PipelineSpec, StageSpec
from omni_jobs.progress_writer import ProgressWriter
from omni_jobs.stage_cache import CachedOutputs, Eviction, StageCache, cache_key, text_digest

log = logging.getLogger(__name__)

RESULTS_CLAIM = "__results__"
"""Claim name of the results step among a job's stage claims (no stage may use this id)."""

ProgressFn = Callable[[int, int], None]


class JobCanceled(Exception):
    """Raised inside an engine callback to stop work for a job that was canceled meanwhile."""


class DeadlineExceeded(JobCanceled):
    """The job's deadline (Cancel-After) passed: it ends canceled, like a user's cancel."""


class StageTimeout(StageError):
    """The stage ran past its soft time limit; it stops at its next step or token."""


@dataclass(frozen=True)
class StageLimits:
    """Time limits (defaults for stages that set none) and how often progress is written."""

    soft_time_limit_s: float = 600.0
    time_limit_s: float = 900.0
    progress_interval_s: float = 0.2

    def for_stage(self, stage: StageSpec) -> tuple[float, float]:
        """(soft, hard) seconds for this stage."""
        return (stage.soft_time_limit_s or self.soft_time_limit_s, stage.time_limit_s or self.time_limit_s)


@dataclass(frozen=True)
class StageOutcome:
    """What one run of a stage did, and what became runnable because of it."""

    status: str  # "succeeded" | "skipped" | "failed" | "canceled"
    next_steps: list[NextStep]


def _execute_ar(engines: EngineCache, stage: StageSpec, params: ARParams, inputs: dict[str, Any], request_id: str,
                progress: ProgressFn, *, policy: BatchPolicy | None = None) -> dict[str, Any]:
    engine = engines.ar(stage.model, stage.engine_args)
    sampling = SamplingOptions(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, seed=params.seed
    )
    prompt = params.prompt_template.format(prompt=inputs["prompt"])
    request = ARRequest(request_id=request_id, prompt=prompt, sampling=sampling)
    if policy is not None:  # concurrent jobs of this worker share one vLLM batch
        output = ar_batcher(engine, policy).submit(request, progress)
    else:
        (output,) = engine.generate([request], on_progress=lambda _rid, done, total: progress(done, total))
    return {"text": output.text, "token_ids": output.token_ids}


def _mark_queued(stage_id: str) -> Callable[[Job], list[JobEvent]]:
    def mutate(job: Job) -> list[JobEvent]:
        if job.stage_record(stage_id).status is StageStatus.pending:
            return state.stage_queued(job, stage_id, now())
        return []

    return mutate


class StageRunner:
    """Runs stages for any pipeline in the catalogue, with engines loaded once per process."""

    def __init__(self, *, store: JobStore, catalogue: PipelineCatalogue, artifacts: ArtifactStore,
                 engines: EngineCache, limits: StageLimits | None = None, batching: BatchDefaults | None = None,
                 cache_redis: redis.Redis | None = None, cache_defaults: tuple[int, Eviction] = (1000, "lru")) -> None:
        """``batching``: engine calls go through the per-engine batcher (stage workers); None calls the
        engine per job. ``cache_redis``: where stages with ``cache.enabled`` keep their outputs."""
        self.store = store
        self.catalogue = catalogue
        self.artifacts = artifacts
        self.engines = engines
        self.limits = limits or StageLimits()
        self.batching = batching
        self.cache_redis = cache_redis
        self.cache_defaults = cache_defaults
        self._caches: dict[tuple[int, str], StageCache] = {}
        self._in_flight: dict[tuple[str, str], threading.BoundedSemaphore] = {}
        self._guard = threading.Lock()
        # Batched engines report for many jobs from one thread: write from another, never inline.
        self.progress = ProgressWriter(store, background=batching is not None)

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
            # A redelivery: the first run may have died between storing and enqueueing, so the
            # next steps are sent again (their own runs are idempotent, a duplicate is skipped).
            log.info("job %s stage %s already succeeded; advancing only", job_id, stage_id)
            return StageOutcome("skipped", self._next_steps(spec, self.store.require(job_id), stage_id, resend=True))
        if job.deadline_at is not None and now() > job.deadline_at:
            self.cancel_for_deadline(job_id)
            return StageOutcome("canceled", [])

        self.store.update(job_id, lambda j: state.stage_started(j, stage_id, worker, now()))
        started = time.perf_counter()
        try:
            inputs = self._load_inputs(spec, stage, job)
            cache, digest = self._stage_cache(spec, stage, job)
            hit = cache.get(f"{spec.name}.{stage.id}", digest) if cache is not None and digest else None
            if hit is not None:  # the same stage config, params and inputs ran before: skip the engine
                refs = self._put_encoded(job_id, stage, hit)
                engine_s = 0.0
            else:
                values = self._execute(stage, job, inputs, spec.name)
                engine_s = time.perf_counter() - started
                encoded = self._encode_outputs(stage, values)
                refs = self._put_encoded(job_id, stage, encoded)
                if cache is not None and digest:
                    cache.put(f"{spec.name}.{stage.id}", digest, encoded.data, encoded.media_types)
        except DeadlineExceeded:
            self.cancel_for_deadline(job_id)
            return StageOutcome("canceled", [])
        except JobCanceled:
            log.info("job %s was canceled during stage %s", job_id, stage_id)
            return StageOutcome("canceled", [])
        except StageError as exc:
            self.fail(job_id, stage_id, exc)
            return StageOutcome("failed", [])
        finally:
            self.progress.finish(job_id, stage_id)
        metrics = {"run_s": time.perf_counter() - started, "engine_s": engine_s}
        if cache is not None and digest:
            metrics["cache_hit"] = 1.0 if hit is not None else 0.0
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

    def time_limits(self, job_id: str, stage_id: str) -> tuple[float, float]:
        """(soft, hard) seconds for this stage of this job (defaults when the job is unknown)."""
        job = self.store.get(job_id)
        if job is None or job.pipeline not in self.catalogue:
            return (self.limits.soft_time_limit_s, self.limits.time_limit_s)
        return self.limits.for_stage(self.catalogue.get(job.pipeline).stage(stage_id))

    def cancel_for_deadline(self, job_id: str) -> None:
        def mutate(job: Job) -> list[JobEvent]:
            if job.status.is_final:
                return []
            return state.job_canceled(job, now(), reason="deadline exceeded (cancel_after)")

        self.store.update(job_id, mutate)
        log.info("job %s passed its deadline; canceled", job_id)

    # --- steps of run() ---
    def _load_inputs(self, spec: PipelineSpec, stage: StageSpec, job: Job) -> dict[str, Any]:
        inputs: dict[str, Any] = {}
        for port, binding in stage.inputs.items():
            if binding.source == INPUT_SOURCE:
                value = job.input[binding.port]
                is_file = spec.inputs[binding.port].type == "image"
                inputs[port] = load_input_image(self.artifacts, value) if is_file else value
                continue
            upstream = spec.stage(binding.source)
            ref = job.stage_record(binding.source).outputs.get(binding.port)
            if ref is None:
                raise StageError(f"stage '{binding.source}' recorded no output '{binding.port}'")
            inputs[port] = decode_payload(upstream.outputs[binding.port], self.artifacts.get(ref))
        return inputs

    def _stage_cache(self, spec: PipelineSpec, stage: StageSpec, job: Job) -> tuple[StageCache | None, str | None]:
        """The stage-output cache of this stage and this job's key in it (None: not cached)."""
        if not stage.cache.enabled or self.cache_redis is None:
            return None, None
        params = job.params.get(stage.id, {})
        resolved = (ARParams(**params) if stage.engine == "ar" and stage.task_name == "generate"
                    else stage.params(params)).model_dump(mode="json")
        if resolved.get("temperature", 0) and resolved.get("seed") is None:
            return None, None  # sampled without a seed: a repeat must not return the same text
        digests: dict[str, str] = {}
        for port, binding in stage.inputs.items():
            if binding.source == INPUT_SOURCE:
                digests[port] = text_digest(job.input.get(binding.port))
            else:
                ref = job.stage_record(binding.source).outputs.get(binding.port)
                digests[port] = ref.sha256 if ref is not None else ""
        config = stage.model_dump(mode="json", include={"engine", "task", "model", "engine_args", "produces"})
        max_entries = stage.cache.max_entries or self.cache_defaults[0]
        eviction: Eviction = stage.cache.eviction or self.cache_defaults[1]
        with self._guard:
            cache = self._caches.get((max_entries, eviction))
            if cache is None:
                cache = self._caches[(max_entries, eviction)] = StageCache(
                    self.cache_redis, max_entries=max_entries, eviction=eviction)
        return cache, cache_key(config, resolved, digests)

    def _in_flight_slot(self, pipeline: str, stage: StageSpec) -> threading.BoundedSemaphore:
        """The per-stage in-flight limit of this process (a stage's batching.max_in_flight)."""
        assert self.batching is not None
        with self._guard:
            key = (pipeline, stage.id)
            if key not in self._in_flight:
                self._in_flight[key] = threading.BoundedSemaphore(self.batching.in_flight(stage))
            return self._in_flight[key]

    def _execute(self, stage: StageSpec, job: Job, inputs: dict[str, Any], pipeline: str = "") -> dict[str, Any]:
        if self.batching is None:
            return self._execute_now(stage, job, inputs, None)
        with self._in_flight_slot(pipeline or job.pipeline, stage):
            return self._execute_now(stage, job, inputs, self.batching.policy(stage))

    def _execute_now(self, stage: StageSpec, job: Job, inputs: dict[str, Any],
                     policy: BatchPolicy | None) -> dict[str, Any]:
        params = job.params.get(stage.id, {})
        progress = self._progress_reporter(job.id, stage, job.deadline_at)
        try:
            request_id = f"{job.id}:{stage.id}"
            if stage.engine == "ar" and stage.task_name == "generate":
                return _execute_ar(self.engines, stage, ARParams(**params), inputs, request_id, progress,
                                   policy=policy)
            if stage.engine == "ar":
                return execute_encode(self.engines, stage, stage.params(params), inputs, request_id, progress)
            return execute_dit(self.engines, stage, stage.params(params), inputs, request_id, progress, policy=policy)
        except (JobCanceled, StageError):
            raise
        except (ValueError, TypeError, RuntimeError, OSError, KeyError) as exc:
            # Engine-level errors (bad model path, bad shape, too long a prompt) do not pass on retry.
            raise StageError(f"{type(exc).__name__}: {exc}") from exc

    def _progress_reporter(self, job_id: str, stage: StageSpec, deadline_at: float | None) -> ProgressFn:
        """Called by the engine at every step/token: records progress (throttled) and is where a
        running stage notices that its job was canceled, passed its deadline, or ran too long."""
        unit = "tokens" if stage.engine == "ar" else "steps"
        soft_limit_s, _hard = self.limits.for_stage(stage)
        started = time.monotonic()
        last_write = float("-inf")

        def report(step: int, total: int) -> None:
            nonlocal last_write
            elapsed = time.monotonic() - started
            if elapsed > soft_limit_s:
                raise StageTimeout(
                    f"stage '{stage.id}' ran {elapsed:.1f}s, past its soft time limit of {soft_limit_s:g}s "
                    f"(set soft_time_limit_s on the stage or OMNI_STAGE_SOFT_TIME_LIMIT_S)"
                )
            if deadline_at is not None and now() > deadline_at:
                raise DeadlineExceeded(job_id)
            if self.progress.canceled(job_id):
                raise JobCanceled(job_id)
            if step < total and time.monotonic() - last_write < self.limits.progress_interval_s:
                return
            last_write = time.monotonic()
            self.progress.report(job_id, stage.id, step, total, unit)
            if self.progress.canceled(job_id):  # an inline write may have just found it
                raise JobCanceled(job_id)

        return report

    def _store_outputs(self, job_id: str, stage: StageSpec, values: dict[str, Any]) -> dict[str, ArtifactRef]:
        return self._put_encoded(job_id, stage, self._encode_outputs(stage, values))

    @staticmethod
    def _encode_outputs(stage: StageSpec, values: dict[str, Any]) -> CachedOutputs:
        """Each output port's bytes in its format (what is stored, and what the stage cache keeps)."""
        data = {port: encode_payload(modality, values[port]) for port, modality in stage.outputs.items()}
        media = {port: FORMATS[modality].media_type for port, modality in stage.outputs.items()}
        return CachedOutputs(data=data, media_types=media)

    def _put_encoded(self, job_id: str, stage: StageSpec, encoded: CachedOutputs) -> dict[str, ArtifactRef]:
        refs: dict[str, ArtifactRef] = {}
        for port, modality in stage.outputs.items():
            fmt = FORMATS[modality]
            key = keys.intermediate_artifact(job_id, stage.id, f"{port}.{fmt.extension}")
            refs[port] = self.artifacts.put_intermediate(key, encoded.data[port], encoded.media_types[port])
        return refs

    def _next_steps(self, spec: PipelineSpec, job: Job, stage_id: str, *, resend: bool = False) -> list[NextStep]:
        """Downstream stages whose inputs are now all ready, or the results step when all are done.

        Each is claimed once per job, so a fan-in stage is not enqueued by both parents; with
        ``resend`` (a redelivered stage) unfinished ones are sent again, claim or not.
        """
        done = {r.id for r in job.stages if r.status is StageStatus.succeeded}
        steps: list[NextStep] = []
        for downstream in spec.downstream(stage_id):
            if not downstream.upstream() <= done or downstream.id in done:
                continue
            if self.store.claim_enqueue(job.id, downstream.id) or resend:
                self.store.update(job.id, _mark_queued(downstream.id))
                steps.append(NextStep(job.id, downstream.id, downstream.queue_name))
        if done == {s.id for s in spec.stages} and (self.store.claim_enqueue(job.id, RESULTS_CLAIM) or resend):
            steps.append(NextStep(job.id, None, RESULTS_QUEUE))
        return steps
