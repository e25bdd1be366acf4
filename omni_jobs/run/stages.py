"""Run one attempt of one stage: take its lease, load its inputs, call its engine, store its
outputs, record the result.

This is the whole of a stage worker's logic; the Celery task around it only adds transport. The
runner composes its parts: the attempt as the ledger sees it (omni_jobs.run.stage_attempt: the lease
taken, held and settled, the result committed), the stage's artifacts (omni_jobs.run.stage_outputs:
inputs loaded, outputs encoded and stored, the stage-output cache, final files begun for results
inline), the engine call (omni_jobs.run.stage_calls) and what the running stage reports
(omni_jobs.run.stage_reports: progress, previews, deltas). Each attempt writes its intermediates under
its own key, so a late attempt never overwrites a newer one's outputs.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait

from omni_jobs.artifacts import ArtifactStore
from omni_jobs.dispatch.leases import LeaseKeeper
from omni_jobs.engines.batching import BatchDefaults
from omni_jobs.engines.pool import EnginePool
from omni_jobs.jobs.ledger import JobLedger, Lease
from omni_jobs.jobs.models import Job, JobEvent, JobOutput
from omni_jobs.jobs.steps import AssembleResults, RunStage, StepOutcome
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.run.run_journal import RunJournal
from omni_jobs.run.stage_attempt import ENDINGS, Retries, StageAttempt, StageLimits
from omni_jobs.run.stage_calls import StageCalls, token_usage
from omni_jobs.run.stage_outputs import EarlyOutputs, InlineResults, StageCaches, StageOutputs
from omni_jobs.run.stage_reports import Reporting, StageReports

log = logging.getLogger(__name__)


class StageRunner:
    """Runs stage attempts for any pipeline in the catalogue, with engines loaded once per process."""

    def __init__(self, *, ledger: JobLedger, catalogue: PipelineCatalogue, artifacts: ArtifactStore,
                 engines: EnginePool, limits: StageLimits | None = None, reporting: Reporting | None = None,
                 retries: Retries | None = None, batching: BatchDefaults | None = None,
                 caches: StageCaches | None = None, keeper: LeaseKeeper | None = None,
                 run_journal: RunJournal | None = None, assemble_results: InlineResults | None = None) -> None:
        """``limits``: time limits (StageLimits); ``reporting``: how often a running stage reports and
        to whom (Reporting); ``retries``: backoff and patience with the store (Retries).
        ``batching``: engine calls go through the per-engine batcher (stage workers); None calls the
        engine per job. ``caches``: where stages with ``cache.enabled`` keep their outputs.
        ``keeper``: renews the leases of running attempts (workers; None in one process).
        ``assemble_results``: results inline: the attempt that completes a job's last stage takes its
        results step in the same write and writes the outputs here (ResultsAssembler), a hop through
        the results queue saved; the files are begun before that write (``EarlyOutputs``). None
        leaves the results step to the results queue."""
        self.ledger = ledger
        self.catalogue = catalogue
        self.artifacts = artifacts
        self.engines = engines
        self.assemble_results = assemble_results
        limits, retries = limits or StageLimits(), retries or Retries()
        self.attempt = StageAttempt(ledger, catalogue, limits=limits, retries=retries, keeper=keeper,
                                    run_journal=run_journal)
        self.outputs = StageOutputs(artifacts, caches=caches, assemble_results=assemble_results)
        # Batched engines report for many jobs from one thread: write from another, never inline.
        self.reports = StageReports(ledger, reporting or Reporting(), background=batching is not None)
        self.calls = StageCalls(engines, catalogue, ledger, reports=self.reports, outputs=self.outputs,
                                limits=limits, retries=retries, batching=batching)

    def run(self, step: RunStage, *, worker: str, owner: str, snapshot: Job | None = None) -> StepOutcome:
        """One attempt: take the lease, run the engine, record the outputs (or the failure).

        ``snapshot``: the job as its task message was pushed (omni_jobs.dispatch.queueing.job_snapshot), so the
        start needs no read first; a stale one is caught by the start's guarded write, and a refusal
        decided on it is checked against the stored job."""
        where = f"job {step.job_id} stage {step.stage_id} attempt {step.attempt}"
        taken = self.attempt.take(step, worker=worker, owner=owner, snapshot=snapshot, where=where)
        if isinstance(taken, StepOutcome):
            return taken
        job, lease = taken.job, taken.lease
        with (self.reports.attending(job, lease),
              self.attempt.held(job, lease, step, on_lost=lambda: self.reports.stop(lease, "lost"))):
            outcome, ended, early = self._attempt(job, lease, step, where, worker)
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
        self.attempt.journal(lease, "engine.start")
        tail: list[JobEvent] = []  # the last text deltas, written with the stage's result
        try:
            inputs = self.outputs.load_inputs(spec, stage, job)
            cache, digest = self.outputs.cache_for(stage, job)
            hit = cache.get(f"{spec.name}.{stage.id}", digest) if cache is not None and digest else None
            tokens: dict[str, float] = {}  # a cached result ran no engine: no tokens to count
            if hit is not None:  # the same stage config, params and inputs ran before: skip the engine
                self.reports.stream_cached_text(stage, job, lease, hit, tail)
                encoded, engine_s = hit, 0.0
            else:
                values = self.calls.execute(stage, job, inputs, lease, tail, spec.name)
                tokens = token_usage(values)
                self.reports.drain(lease)  # its last preview goes out before the stage's result
                engine_s = time.perf_counter() - started
                encoded = self.outputs.encode(stage, values)
            writes += self.outputs.begin_files(job, step, encoded)
            refs, files = self.outputs.store(spec, stage, job.id, step.attempt, encoded, writes)
            if hit is None and cache is not None and digest:
                cache.put(f"{spec.name}.{stage.id}", digest, encoded.data, encoded.media_types)
        except ENDINGS as exc:
            return self.attempt.settle(exc, job, lease, step, where), None, None
        metrics = {"run_s": time.perf_counter() - started, "engine_s": engine_s, **tokens}
        if cache is not None and digest:
            metrics["cache_hit"] = 1.0 if hit is not None else 0.0
        return self.attempt.commit(job, lease, step, refs, metrics, files=files, writes=writes, tail=tail,
                                   results_worker=worker if self.assemble_results is not None else None, where=where)
