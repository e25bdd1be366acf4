"""Run one attempt of one stage: take its lease, load its inputs, call its engine, store its
outputs, record the result.

This is the whole of a stage worker's logic; the Celery task around it only adds transport. The
attempt is fenced by its lease (omni_jobs.jobs.ledger): a duplicate or stale message is refused
before any work, a result recorded only while the lease holds, and what the result makes runnable
(the next stages, the results step) is dispatched in the same write. Each attempt writes its
intermediates under its own key, so a late attempt never overwrites a newer one's outputs.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Literal, Protocol, TypeAlias, TypeVar

import redis

from omni_jobs import keys
from omni_jobs.artifacts import ArtifactRef, ArtifactStore, ArtifactStoreUnavailable
from omni_jobs.code_stream import CODES_DELTA_INTERVAL_S, CODES_FIELD, codes_text
from omni_jobs.engines.ar import AROutput, TextSoFar
from omni_jobs.engines.batching import BatchDefaults, BatchPolicy, ar_batcher, for_tenant
from omni_jobs.engines.pool import EnginePool
from omni_jobs.engines.stage_exec import (
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
from omni_jobs.errors import JobAlreadyFinished, JobNotFound, StageError, TransientStageError
from omni_jobs.followed import Ask, FollowedJobs
from omni_jobs.input_files import load_input_file
from omni_jobs.jobs.ledger import JobLedger, Lease, Refused, WrittenOutputs
from omni_jobs.jobs.models import EventType, Job, JobError, JobEvent, JobOutput, JobStatus, StageStatus, now
from omni_jobs.jobs.patience import STORE_DOWN, while_store_down
from omni_jobs.json_types import JsonObject, JsonValue
from omni_jobs.leases import LeaseKeeper
from omni_jobs.payloads import FORMATS, Payload, decode_payload, encode_payload
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.params import ARParams, DiTCode2WavParams, StageParams
from omni_jobs.pipelines.spec import INPUT_SOURCE, Binding, PipelineSpec, StageSpec
from omni_jobs.previews import LatentPreview
from omni_jobs.progress_writer import ProgressWriter
from omni_jobs.run_journal import RunJournal
from omni_jobs.speech_stage import JobEnded, run_streamed_code2wav
from omni_jobs.stage_cache import CachedOutputs, Eviction, StageOutputCache, cache_key, text_digest
from omni_jobs.steps import AssembleResults, RunStage, StepOutcome
from omni_jobs.text_stream import DELTA_INTERVAL_S, Publish, TextDeltas, TextStreams, publish_each
from omni_jobs.watchdog import hard_time_limit

log = logging.getLogger(__name__)

T = TypeVar("T")
STREAM_READ_MS = 500
"""How long a streamed stage's read of its job's events waits for its upstream's next delta."""
ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class EarlyOutputs:
    """A job's final files, being written while its last stage's outputs are stored and the write
    that records that stage commits (results inline): they wait on storage side by side (an fsync,
    an upload) instead of one after the other, and the stage's own outputs are not read back from
    the store (bench --hops: last stage -> results done). ``made_from``: each stage's outputs they
    were made of; they stand only if the committed job has the same."""

    made_from: list[dict[str, ArtifactRef]]
    writes: list[Future[JobOutput]]


def _finished(writes: Sequence[Future[JobOutput]]) -> list[JobOutput] | None:
    """The final files begun for results inline, once all are written: the stage's completion then
    ends the job in its own write. None if there are none, or one failed (the results step then
    runs as usual and handles the error)."""
    if not writes:
        return None
    wait(writes)
    if any(f.exception() is not None for f in writes):
        return None
    return [f.result() for f in writes]


class InlineResults(Protocol):
    """The results step, run by the worker whose stage completed the job (ResultsAssembler)."""

    def start_outputs(self, job: Job, fresh: Mapping[tuple[str, str], bytes] | None = None) -> list[Future[JobOutput]]:
        """Begin writing each declared output of ``job``; ``fresh``: the bytes of (stage, port) outputs
        that are not read from the store (a stage's own, not stored yet)."""
        ...

    def run_held(self, job: Job, lease: Lease, early: EarlyOutputs | None = None) -> StepOutcome:
        """The results step of a job whose results lease this process holds."""
        ...

    def verbatim_ports(self, spec: PipelineSpec, stage_id: str) -> dict[str, str]:
        """The ports of this stage whose bytes an output's file holds as they are: port -> output name."""
        ...

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (ArtifactStoreUnavailable, TransientStageError, *STORE_DOWN)
"""Errors that may pass (a store or the broker unreachable): the next attempt backs off and retries."""
StageInputs: TypeAlias = "dict[str, Payload | JsonValue | list[Payload | JsonValue]]"
"""A stage's inputs by port, as its engine is handed them: a job input (JSON; an image input loaded
as a PIL image) or an upstream stage's output, decoded."""


@dataclass(frozen=True, eq=False)
class _DeltaTarget:
    """Where one running stage's text deltas go (its job's stream, under its lease): a ``Publish``
    that the text writer can also hand to ``JobLedger.publish_many`` with others."""

    ledger: JobLedger
    lease: Lease
    job: Job

    def __call__(self, data: JsonObject) -> str:
        return self.ledger.publish(self.lease, self.job, EventType.output_delta, data)


class JobCanceled(Exception):
    """Raised inside an engine callback to stop work for a job that was canceled meanwhile."""


class DeadlineExceeded(JobCanceled):
    """The job's deadline (Cancel-After) passed: it ends canceled, like a user's cancel."""


class LeaseLost(JobCanceled):
    """This attempt's lease was taken back (the worker was cut off): another attempt runs it."""


class StageTimeout(StageError):
    """The stage ran past its soft time limit; it stops at its next step or token."""


def job_error(stage_id: str | None, exc: BaseException) -> JobError:
    """The error a failed step records on its job: the stage, the exception type and its message."""
    return JobError(stage=stage_id, type=type(exc).__name__, message=str(exc) or repr(exc))


@dataclass(frozen=True)
class StageLimits:
    """Time limits (defaults for stages that set none) and how often progress is written: while a
    reader looks at the job, and while nobody does (omni_jobs.followed)."""

    soft_time_limit_s: float = 600.0
    time_limit_s: float = 900.0
    progress_interval_s: float = 0.2
    progress_unfollowed_interval_s: float = 1.0

    def for_stage(self, stage: StageSpec) -> tuple[float, float]:
        """(soft, hard) seconds for this stage."""
        return (stage.soft_time_limit_s or self.soft_time_limit_s, stage.time_limit_s or self.time_limit_s)


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
    counts (omni_jobs.usage). Nothing for a stage whose values carry no usage."""
    text = values.get("text")
    usage = text.get("usage") if isinstance(text, dict) else None
    if not isinstance(usage, dict):
        return {}
    return {name: float(usage[name]) for name in ("prompt_tokens", "completion_tokens")
            if isinstance(usage.get(name), int | float)}


class StageRunner:
    """Runs stage attempts for any pipeline in the catalogue, with engines loaded once per process."""

    def __init__(self, *, ledger: JobLedger, catalogue: PipelineCatalogue, artifacts: ArtifactStore,
                 engines: EnginePool, limits: StageLimits | None = None, batching: BatchDefaults | None = None,
                 cache_redis: redis.Redis | None = None, cache_defaults: tuple[int, Eviction] = (1000, "lru"),
                 keeper: LeaseKeeper | None = None, retry_backoff_s: float = 1.0, store_wait_s: float = 600.0,
                 run_journal: RunJournal | None = None, assemble_results: InlineResults | None = None,
                 hard_limits: bool = False, text_delta_interval_s: float = DELTA_INTERVAL_S,
                 followed: Ask | None = None, text_deltas: Literal["followed", "always"] = "followed") -> None:
        """``batching``: engine calls go through the per-engine batcher (stage workers); None calls the
        engine per job. ``cache_redis``: where stages with ``cache.enabled`` keep their outputs.
        ``keeper``: renews the leases of running attempts (workers; None in one process).
        ``assemble_results``: results inline: the attempt that completes a job's last stage takes its
        results step in the same write and writes the outputs here (ResultsAssembler), a hop through
        the results queue saved; the files are begun before that write (``EarlyOutputs``). None
        leaves the results step to the results queue.
        ``hard_limits``: a stage still running at its hard time limit fails its job and ends this
        process (omni_jobs.watchdog; worker processes only: the supervisor starts a fresh one).
        ``text_delta_interval_s``: the least time between two ``output.delta`` writes of one output
        while it runs (the last delta goes with the stage's result).
        ``followed``: asks who reads which jobs now (omni_jobs.followed). A running stage writes its
        progress every ``limits.progress_interval_s`` while its job is followed or looked at, else
        every ``progress_unfollowed_interval_s``; with ``text_deltas`` 'followed', its text deltas go
        out only while a stream follows it, and the rest with the stage's result (TextStreams).
        None: every job counts as followed."""
        self.ledger = ledger
        self.catalogue = catalogue
        self.artifacts = artifacts
        self.engines = engines
        self.limits = limits or StageLimits()
        self.batching = batching
        self.cache_redis = cache_redis
        self.cache_defaults = cache_defaults
        self.keeper = keeper
        self.retry_backoff_s = retry_backoff_s
        self.store_wait_s = store_wait_s
        self.run_journal = run_journal
        self.assemble_results = assemble_results
        self.hard_limits = hard_limits
        self._caches: dict[tuple[int, str], StageOutputCache] = {}
        self._in_flight: dict[tuple[str, str], threading.BoundedSemaphore] = {}
        self._guard = threading.Lock()
        # Batched engines report for many jobs from one thread: write from another, never inline.
        self.progress = ProgressWriter(ledger, background=batching is not None)
        self.followed = FollowedJobs(followed)
        self.text_streams = TextStreams(background=batching is not None, publish_many=self._publish_deltas,
                                        interval_s=text_delta_interval_s,
                                        followed=self.followed.followed_among if text_deltas == "followed" else None)

    def _patiently(self, call: Callable[[], T], what: str) -> T:
        return while_store_down(call, wait_s=self.store_wait_s, what=what)

    def run(self, step: RunStage, *, worker: str, owner: str, snapshot: Job | None = None) -> StepOutcome:
        """One attempt: take the lease, run the engine, record the outputs (or the failure).

        ``snapshot``: the job as its task message was pushed (omni_jobs.queueing.job_snapshot), so the
        start needs no read first; a stale one is caught by the start's guarded write, and a refusal
        decided on it is checked against the stored job."""
        where = f"job {step.job_id} stage {step.stage_id} attempt {step.attempt}"
        job = snapshot if snapshot is not None else self._patiently(lambda: self.ledger.get(step.job_id), where)
        if job is None:
            return StepOutcome("skipped", "job is gone (expired or deleted)")
        taken = self._patiently(lambda: self.ledger.acquire(step, worker=worker, owner=owner, snapshot=job), where)
        if isinstance(taken, Refused) and snapshot is not None:
            taken = self._patiently(lambda: self.ledger.acquire(step, worker=worker, owner=owner), where)
        if isinstance(taken, Refused):
            return StepOutcome("skipped", taken.reason)
        job, lease = taken.job, taken.lease
        self.progress.begin(lease)
        self.followed.track(job.id)
        try:
            with self._hard_limit(job, lease, step):
                if self.keeper is None:
                    outcome, ended, early = self._attempt(job, lease, step, where, worker)
                else:
                    with self.keeper.hold(lease, on_lost=lambda: self.progress.stop(lease, "lost")):
                        outcome, ended, early = self._attempt(job, lease, step, where, worker)
        finally:
            self.followed.untrack(job.id)
            self.progress.finish(lease)
        if ended is not None and self.assemble_results is not None:
            held = Lease(AssembleResults(ended.id, ended.results.attempts), lease.owner)
            results = self.assemble_results.run_held(ended, held, early)
            log.info("%s: results assembled inline: %s", where, results.status)
        return outcome

    def _attempt(self, job: Job, lease: Lease, step: RunStage, where: str,
                 worker: str) -> tuple[StepOutcome, Job | None, EarlyOutputs | None]:
        """The attempt's outcome; the job when this attempt took its results step (results inline), and
        the outputs it began writing for that step (handed on only then; else ended here)."""
        writes: list[Future[JobOutput]] = []
        took_results = False
        try:
            outcome, done, early = self._record(job, lease, step, where, worker, writes)
            took_results = early is not None
            return outcome, done, early
        finally:
            if writes and not took_results:
                wait(writes)  # not this attempt's to finish: no write outlives it

    def _record(self, job: Job, lease: Lease, step: RunStage, where: str, worker: str,
                writes: list[Future[JobOutput]]) -> tuple[StepOutcome, Job | None, EarlyOutputs | None]:
        """Run the stage and record its outputs; the final files this attempt begins go into ``writes``."""
        spec = self.catalogue.get(job.pipeline)
        stage = spec.stage(step.stage_id)
        started = time.perf_counter()
        if self.run_journal is not None:
            self.run_journal.record(lease, "engine.start")
        tail: list[JobEvent] = []  # the last text deltas, written with the stage's result
        try:
            inputs = self._load_inputs(spec, stage, job)
            cache, digest = self._stage_cache(spec, stage, job)
            hit = cache.get(f"{spec.name}.{stage.id}", digest) if cache is not None and digest else None
            tokens: dict[str, float] = {}  # a cached result ran no engine: no tokens to count
            if hit is not None:  # the same stage config, params and inputs ran before: skip the engine
                self._stream_cached_text(stage, job, lease, hit, tail)
                encoded, engine_s = hit, 0.0
            else:
                values = self._execute(stage, job, inputs, lease, tail, spec.name)
                tokens = token_usage(values)
                self.progress.drain(lease)  # its last preview goes out before the stage's result
                engine_s = time.perf_counter() - started
                encoded = self._encode_outputs(stage, values)
            writes += self._begin_outputs(job, step, encoded)
            refs, files = self._store_outputs(spec, stage, job.id, step.attempt, encoded, writes)
            if hit is None and cache is not None and digest:
                cache.put(f"{spec.name}.{stage.id}", digest, encoded.data, encoded.media_types)
        except JobCanceled as exc:
            why = "lost" if isinstance(exc, LeaseLost) else "canceled"
            if isinstance(exc, DeadlineExceeded):
                self._patiently(lambda: self.cancel_for_deadline(job.id), where)
            log.info("%s stopped: %s", where, "its lease was lost" if why == "lost" else "the job was canceled")
            return StepOutcome(why, str(exc)), None, None
        except StageError as exc:
            error = job_error(stage.id, exc)
            self._patiently(lambda: self.ledger.fail(job.id, error, lease=lease), where)
            log.error("%s failed: %s", where, exc)
            return StepOutcome("failed", str(exc)), None, None
        except TRANSIENT_ERRORS as exc:
            delay, error = self.retry_delay(step.attempt), job_error(stage.id, exc)
            outcome = self._patiently(lambda: self.ledger.retry_later(lease, error, delay), where)
            log.warning("%s: transient error (%s: %s); %s", where, type(exc).__name__, exc,
                        f"attempt {step.attempt + 1} in {delay:.1f}s" if outcome == "retrying" else outcome)
            return StepOutcome("retrying" if outcome == "retrying" else outcome, str(exc)), None, None
        metrics = {"run_s": time.perf_counter() - started, "engine_s": engine_s, **tokens}
        if cache is not None and digest:
            metrics["cache_hit"] = 1.0 if hit is not None else 0.0
        inline = worker if self.assemble_results is not None else None
        made_from = [dict(refs) if r.id == step.stage_id else dict(r.outputs) for r in job.stages]
        written = WrittenOutputs(made_from, files) if files is not None else None
        done = self._patiently(lambda: self.ledger.complete_stage(lease, refs, metrics, snapshot=job,
                                                                  results_worker=inline, first=tail, written=written),
                               where)
        if isinstance(done, Refused):
            log.warning("%s: result discarded: %s", where, done.reason)
            return StepOutcome("discarded", done.reason), None, None
        if self.run_journal is not None:
            self.run_journal.record(lease, "engine.recorded")
        if written is not None and done.status is JobStatus.succeeded and done.outputs == written.outputs:
            log.info("%s: job succeeded with outputs %s (results inline)", where, [o.name for o in done.outputs])
            return StepOutcome("succeeded", ""), None, None
        took_results = (inline is not None and done.results.status is StageStatus.running
                        and done.results.lease_owner == lease.owner)
        if not took_results or not writes:
            return StepOutcome("succeeded", ""), done if took_results else None, None
        return StepOutcome("succeeded", ""), done, EarlyOutputs(made_from, list(writes))

    def _store_outputs(self, spec: PipelineSpec, stage: StageSpec, job_id: str, attempt: int, encoded: CachedOutputs,
                       writes: Sequence[Future[JobOutput]]) -> tuple[dict[str, ArtifactRef], list[JobOutput] | None]:
        """The stage's outputs stored, by port, and the job's files begun for results inline once all
        are written (None: none begun, or one failed). A port whose bytes such a file holds as they
        are is that file, not a second copy; if a file failed, it is stored after all (the results
        step will read it)."""
        verbatim = self.assemble_results.verbatim_ports(spec, stage.id) if writes and self.assemble_results else {}
        refs = self._put_encoded(job_id, stage, encoded, attempt, [p for p in stage.outputs if p not in verbatim])
        files = _finished(writes)
        if verbatim:
            if files is None:
                refs.update(self._put_encoded(job_id, stage, encoded, attempt, list(verbatim)))
            else:
                in_files = {o.name: o.artifact for o in files}
                refs.update({port: in_files[name] for port, name in verbatim.items()})
        return refs, files

    def _begin_outputs(self, job: Job, step: RunStage, encoded: CachedOutputs) -> list[Future[JobOutput]]:
        """Results inline, and this is the job's last stage to finish: begin its final files now, from
        this stage's own bytes and the other stages' stored outputs, so that they are written while this
        stage's outputs are stored and its completion commits."""
        if self.assemble_results is None or any(
                r.status is not StageStatus.succeeded for r in job.stages if r.id != step.stage_id):
            return []
        fresh = {(step.stage_id, port): data for port, data in encoded.data.items()}
        return self.assemble_results.start_outputs(job, fresh)

    def retry_delay(self, attempt: int) -> float:
        """Exponential backoff with jitter before the next attempt after a transient error."""
        return float(self.retry_backoff_s * (2 ** (attempt - 1)) * random.uniform(0.5, 1.5))

    def _hard_limit(self, job: Job, lease: Lease, step: RunStage) -> AbstractContextManager[None]:
        """The attempt's hard time limit (``hard_limits``): past it, the job fails (while this attempt's
        lease holds) and the process ends."""
        if not self.hard_limits or job.pipeline not in self.catalogue:
            return nullcontext()
        _soft, hard = self.limits.for_stage(self.catalogue.get(job.pipeline).stage(step.stage_id))
        timeout = StageTimeout(f"stage '{step.stage_id}' ran past its hard time limit of {hard:g}s; its worker was "
                               "restarted (set time_limit_s on the stage or OMNI_STAGE_TIME_LIMIT_S)")

        def on_expire() -> None:
            self.ledger.fail(job.id, job_error(step.stage_id, timeout), lease=lease)

        return hard_time_limit(hard, on_expire)

    def cancel_for_deadline(self, job_id: str) -> None:
        try:
            self.ledger.cancel(job_id, reason="deadline exceeded (cancel_after)")
            log.info("job %s passed its deadline; canceled", job_id)
        except (JobAlreadyFinished, JobNotFound):
            pass

    # --- steps of run() ---
    def _load_inputs(self, spec: PipelineSpec, stage: StageSpec, job: Job) -> StageInputs:
        inputs: StageInputs = {}
        for port, bound in stage.inputs.items():
            if port == stage.stream_input:
                continue  # read while its upstream writes it (omni_jobs.speech_stage)
            given = [b for b in (bound if isinstance(bound, tuple) else (bound,)) if self._given(b, job)]
            if not given:
                continue  # an optional job input left out: the port is not fed (a chat without an image)
            if isinstance(bound, tuple):  # a port wired to several sources gets their values as a list
                inputs[port] = [self._load_input(spec, binding, job) for binding in given]
            else:
                inputs[port] = self._load_input(spec, bound, job)
        return inputs

    @staticmethod
    def _given(binding: Binding, job: Job) -> bool:
        return binding.source != INPUT_SOURCE or job.input.get(binding.port) is not None

    def _load_input(self, spec: PipelineSpec, binding: Binding, job: Job) -> Payload | JsonValue:
        """One source's value: a job input (JSON; a file input loaded: a PIL image, AudioClip or VideoClip)
        or an upstream output."""
        if binding.source == INPUT_SOURCE:
            value = job.input[binding.port]
            field = spec.inputs[binding.port]
            return load_input_file(self.artifacts, field.type, value) if field.is_file else value
        upstream = spec.stage(binding.source)
        ref = job.stage_record(binding.source).outputs.get(binding.port)
        if ref is None:
            raise StageError(f"stage '{binding.source}' recorded no output '{binding.port}'")
        return decode_payload(upstream.outputs[binding.port], self.artifacts.get(ref))

    def _stage_cache(self, spec: PipelineSpec, stage: StageSpec, job: Job) -> tuple[StageOutputCache | None, str | None]:
        """The stage-output cache of this stage and this job's key in it (None: not cached)."""
        if not stage.cache.enabled or self.cache_redis is None:
            return None, None
        params = job.params.get(stage.id, {})
        resolved = (ARParams.model_validate(params) if stage.engine == "ar" and stage.task_name == "generate"
                    else stage.params(params)).model_dump(mode="json", exclude={"preview_every"})  # no output change
        if resolved.get("temperature", 0) and resolved.get("seed") is None:
            return None, None  # sampled without a seed: a repeat must not return the same text
        digests: dict[str, str] = {}
        for port, binding in stage.bindings():
            if binding.source == INPUT_SOURCE:
                digest = text_digest(job.input.get(binding.port))
            else:
                ref = job.stage_record(binding.source).outputs.get(binding.port)
                digest = ref.sha256 if ref is not None else ""
            digests[port] = f"{digests[port]},{digest}" if port in digests else digest
        config = stage.model_dump(mode="json", include={"engine", "task", "model", "engine_args", "produces"})
        max_entries = stage.cache.max_entries or self.cache_defaults[0]
        eviction: Eviction = stage.cache.eviction or self.cache_defaults[1]
        with self._guard:
            cache = self._caches.get((max_entries, eviction))
            if cache is None:
                cache = self._caches[(max_entries, eviction)] = StageOutputCache(
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

    def _execute(self, stage: StageSpec, job: Job, inputs: StageInputs, lease: Lease, tail: list[JobEvent],
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
        progress = self._progress_reporter(job, stage, lease)
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
                               preview=self._preview_publisher(job, stage, lease))
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
        deltas = self._open_text(stage, job, lease) if "text" in stage.outputs else None
        try:
            output = _execute_ar(self.engines, stage, params, inputs, f"{job.id}:{stage.id}", progress,
                                 policy=policy, on_text=deltas.update if deltas is not None else None)
            if deltas is not None:
                self._finish_text(deltas, output.text, job, tail)
            handover = thinker_handover(self.engines, stage, params, inputs, f"{job.id}:{stage.id}", output)
            return {**_ar_values(output), **handover}
        finally:
            if deltas is not None:
                self.text_streams.discard(deltas)

    def _execute_talk(self, stage: StageSpec, job: Job, params: StageParams, inputs: StageInputs, lease: Lease,
                      progress: ProgressFn, policy: BatchPolicy | None, tail: list[JobEvent]) -> StageValues:
        """A talker; where a stage downstream reads its codes while they are written (a streamed code2wav), they go
        to the job's stream as they come (``output.delta`` of ``audio_codes``; omni_jobs.code_stream), whether or
        not a client follows the job: that stage does."""
        streamed = "audio_codes" in self.catalogue.get(job.pipeline).streamed_outputs(stage.id)
        deltas = self.text_streams.open(stage.id, "audio_codes", _DeltaTarget(self.ledger, lease, job),
                                        attempt=lease.attempt, on_stop=lambda why: self.progress.stop(lease, why),
                                        field=CODES_FIELD, interval_s=CODES_DELTA_INTERVAL_S) if streamed else None
        try:
            values = execute_talk(self.engines, stage, params, inputs, f"{job.id}:{stage.id}", progress, policy=policy,
                                  on_codes=(lambda codes: deltas.update(codes_text(codes))) if deltas else None)
            if deltas is not None:
                codes = code_ids(values["audio_codes"], "audio_codes")
                self._finish_text(deltas, codes_text([int(c) for c in codes.tolist()]), job, tail)
            return values
        finally:
            if deltas is not None:
                self.text_streams.discard(deltas)

    def _execute_streamed_code2wav(self, stage: StageSpec, job: Job, params: StageParams, inputs: StageInputs,
                                   lease: Lease, progress: ProgressFn, policy: BatchPolicy | None) -> StageValues:
        """A code2wav that runs beside its talker (omni_jobs.speech_stage), its audio deltas published under this
        attempt's lease."""
        assert isinstance(params, DiTCode2WavParams)
        source = stage.stream_source
        assert source is not None
        target = _DeltaTarget(self.ledger, lease, job)
        where = f"job {job.id} stage {stage.id}"

        def publish(data: JsonObject) -> None:
            outcome = self._patiently(lambda: target(data), where)
            if outcome == "lost":
                raise LeaseLost(job.id)
            if outcome != "ok":
                raise JobCanceled(job.id)

        def recorded_codes() -> object:
            current = self._patiently(lambda: self.ledger.get(job.id), where)
            if current is None:
                raise JobCanceled(job.id)
            return self._load_input(self.catalogue.get(job.pipeline), source, current)

        return run_streamed_code2wav(
            self.engines, stage, job.id, params, inputs, lease.attempt,
            read=lambda after: self._patiently(
                lambda: self.ledger.events(job.id, after=after, block_ms=STREAM_READ_MS), where),
            recorded_codes=recorded_codes, publish=publish, progress=progress,
            expected_codes=int(str(job.params.get(source.source, {}).get("max_tokens", 0) or 0)), policy=policy)

    def _finish_text(self, deltas: TextDeltas, text: str, job: Job, tail: list[JobEvent]) -> None:
        """The rest of a streamed text becomes the last delta, in ``tail``; a refused publish
        on the way (canceled, lease lost) stops the stage."""
        why, data = self.text_streams.finish(deltas, text)
        if why == "lost":
            raise LeaseLost(job.id)
        if why != "ok":
            raise JobCanceled(job.id)
        if data is not None:
            tail.append(JobEvent(job_id=job.id, type=EventType.output_delta, at=now(), data=data))

    def _stream_cached_text(self, stage: StageSpec, job: Job, lease: Lease, hit: CachedOutputs,
                            tail: list[JobEvent]) -> None:
        """A cached AR text still reaches the job's stream: as one delta, so that a streaming reader
        sees the same text whether the engine ran or not."""
        if stage.engine == "ar" and stage.task_name == "generate" and "text" in stage.outputs:
            self._finish_text(self._open_text(stage, job, lease), decode_payload("text", hit.data["text"]), job, tail)

    def _open_text(self, stage: StageSpec, job: Job, lease: Lease) -> TextDeltas:
        return self.text_streams.open(stage.id, "text", _DeltaTarget(self.ledger, lease, job), attempt=lease.attempt,
                                      on_stop=lambda why: self.progress.stop(lease, why), job_id=job.id)

    def _publish_deltas(self, items: Sequence[tuple[Publish, JsonObject]]) -> list[str]:
        """The text writer's ``PublishMany``: the deltas of all running stages due together, in one
        round trip (``JobLedger.publish_many``)."""
        writes = [(p.lease, p.job, EventType.output_delta, data) for p, data in items if isinstance(p, _DeltaTarget)]
        if len(writes) < len(items):  # some other Publish: each on its own
            return publish_each(items)
        return self.ledger.publish_many(writes)

    def _progress_reporter(self, job: Job, stage: StageSpec, lease: Lease) -> ProgressFn:
        """Called by the engine at every step/token: records progress and is where a running stage
        notices that its job was canceled, its lease lost, its deadline passed, or that it ran too long.

        While a reader looks at the job, progress is written often, its first and last step always.
        While nobody does, it is written seldom, counted from the first step: a stage shorter than
        that writes none (its start and its end are events of their own, and the end clears the
        job's progress). Those two writes were a commit each for every job of a batch, beside the
        engine: without them a DiT 32px small job runs 4.4 scripts in Redis instead of 6.7
        (docs/decisions/progress-nobody-reads.md)."""
        unit = "tokens" if stage.engine == "ar" else "steps"
        soft_limit_s, _hard = self.limits.for_stage(stage)
        often, seldom = self.limits.progress_interval_s, self.limits.progress_unfollowed_interval_s
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

    def _preview_publisher(self, job: Job, stage: StageSpec, lease: Lease) -> Callable[[LatentPreview], None]:
        """Where a DiT stage's previews go: the progress writer encodes and publishes them off the
        engine's thread (a refused publish stops the stage at its next step, as progress does)."""

        def publish(preview: LatentPreview) -> None:
            self.progress.preview(lease, job, lambda: preview.event_data(stage.id))

        return publish

    @staticmethod
    def _encode_outputs(stage: StageSpec, values: StageValues) -> CachedOutputs:
        """Each output port's bytes in its format (what is stored, and what the stage-output cache keeps)."""
        data = {port: encode_payload(modality, values[port]) for port, modality in stage.outputs.items()}
        media = {port: FORMATS[modality].media_type for port, modality in stage.outputs.items()}
        return CachedOutputs(data=data, media_types=media)

    def _put_encoded(self, job_id: str, stage: StageSpec, encoded: CachedOutputs, attempt: int,
                     ports: Sequence[str] | None = None) -> dict[str, ArtifactRef]:
        """Store the stage's outputs (``ports``: these of them) as intermediates; their refs by port."""
        ports = list(stage.outputs) if ports is None else list(ports)
        if not ports:
            return {}
        items = [(keys.intermediate_artifact(job_id, stage.id, f"{port}.{FORMATS[stage.outputs[port]].extension}", attempt),
                  encoded.data[port], encoded.media_types[port]) for port in ports]
        return dict(zip(ports, self.artifacts.put_intermediates(items), strict=True))
