"""A stage's artifacts, in and out: its inputs loaded from the job and its upstream stages' stored
outputs, its engine's values encoded and stored under its attempt's own keys, the stage-output cache
that can stand in for the engine, and the job's final files begun early for results inline.

Split from the stage runner (omni_jobs.run.stages) so that what is stored, and how, reads apart from
when an attempt may store it (omni_jobs.run.stage_attempt) and what it tells its readers meanwhile
(omni_jobs.run.stage_reports).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import redis

from omni_jobs.artifacts import ArtifactRef, ArtifactStore
from omni_jobs.core import keys
from omni_jobs.core.errors import StageError
from omni_jobs.core.json_types import JsonValue
from omni_jobs.engines.stage_exec import StageValues
from omni_jobs.jobs.ledger import Lease
from omni_jobs.jobs.models import Job, JobOutput, StageStatus
from omni_jobs.jobs.steps import RunStage, StepOutcome
from omni_jobs.media.input_files import load_input_file
from omni_jobs.media.payloads import FORMATS, Payload, decode_payload, encode_payload
from omni_jobs.pipelines.params import ARParams
from omni_jobs.pipelines.spec import INPUT_SOURCE, Binding, PipelineSpec, StageSpec
from omni_jobs.run.stage_cache import CachedOutputs, Eviction, StageOutputCache, cache_key, text_digest

StageInputs: TypeAlias = "dict[str, Payload | JsonValue | list[Payload | JsonValue]]"
"""A stage's inputs by port, as its engine is handed them: a job input (JSON; an image input loaded
as a PIL image) or an upstream stage's output, decoded."""


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


class StageCaches:
    """The stage-output caches of a process, one per (max_entries, eviction) that stages ask for, in
    one Redis: built on first use, shared by every attempt that runs a stage with ``cache.enabled``."""

    def __init__(self, client: redis.Redis, *, max_entries: int = 1000, eviction: Eviction = "lru") -> None:
        """``max_entries``, ``eviction``: for stages whose ``cache:`` sets none."""
        self.client = client
        self.max_entries = max_entries
        self.eviction: Eviction = eviction
        self._caches: dict[tuple[int, str], StageOutputCache] = {}
        self._guard = threading.Lock()

    def lookup(self, stage: StageSpec, job: Job) -> tuple[StageOutputCache | None, str | None]:
        """The cache of this stage and this job's key in it (None: not cached)."""
        if not stage.cache.enabled:
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
        max_entries = stage.cache.max_entries or self.max_entries
        eviction: Eviction = stage.cache.eviction or self.eviction
        with self._guard:
            cache = self._caches.get((max_entries, eviction))
            if cache is None:
                cache = self._caches[(max_entries, eviction)] = StageOutputCache(
                    self.client, max_entries=max_entries, eviction=eviction)
        return cache, cache_key(config, resolved, digests)


class StageOutputs:
    """Reads a stage's inputs and stores its outputs, for every attempt of every stage of a process."""

    def __init__(self, artifacts: ArtifactStore, *, caches: StageCaches | None = None,
                 assemble_results: InlineResults | None = None) -> None:
        """``caches``: where stages with ``cache.enabled`` keep their outputs (None: no stage's are kept).
        ``assemble_results``: results inline (omni_jobs.run.stages.StageRunner): the job's final files
        are begun here, beside the last stage's own outputs."""
        self.artifacts = artifacts
        self.caches = caches
        self.assemble_results = assemble_results

    def load_inputs(self, spec: PipelineSpec, stage: StageSpec, job: Job) -> StageInputs:
        """The values of the stage's input ports that the job feeds."""
        inputs: StageInputs = {}
        for port, bound in stage.inputs.items():
            if port == stage.stream_input:
                continue  # read while its upstream writes it (omni_jobs.run.speech_stage)
            given = [b for b in (bound if isinstance(bound, tuple) else (bound,)) if self._given(b, job)]
            if not given:
                continue  # an optional job input left out: the port is not fed (a chat without an image)
            if isinstance(bound, tuple):  # a port wired to several sources gets their values as a list
                inputs[port] = [self.load_input(spec, binding, job) for binding in given]
            else:
                inputs[port] = self.load_input(spec, bound, job)
        return inputs

    @staticmethod
    def _given(binding: Binding, job: Job) -> bool:
        return binding.source != INPUT_SOURCE or job.input.get(binding.port) is not None

    def load_input(self, spec: PipelineSpec, binding: Binding, job: Job) -> Payload | JsonValue:
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

    def cache_for(self, stage: StageSpec, job: Job) -> tuple[StageOutputCache | None, str | None]:
        """The stage-output cache of this stage and this job's key in it (None: not cached)."""
        if self.caches is None:
            return None, None
        return self.caches.lookup(stage, job)

    @staticmethod
    def encode(stage: StageSpec, values: StageValues) -> CachedOutputs:
        """Each output port's bytes in its format (what is stored, and what the stage-output cache keeps)."""
        data = {port: encode_payload(modality, values[port]) for port, modality in stage.outputs.items()}
        media = {port: FORMATS[modality].media_type for port, modality in stage.outputs.items()}
        return CachedOutputs(data=data, media_types=media)

    def begin_files(self, job: Job, step: RunStage, encoded: CachedOutputs) -> list[Future[JobOutput]]:
        """Results inline, and this is the job's last stage to finish: begin its final files now, from
        this stage's own bytes and the other stages' stored outputs, so that they are written while this
        stage's outputs are stored and its completion commits."""
        if self.assemble_results is None or any(
                r.status is not StageStatus.succeeded for r in job.stages if r.id != step.stage_id):
            return []
        fresh = {(step.stage_id, port): data for port, data in encoded.data.items()}
        return self.assemble_results.start_outputs(job, fresh)

    def store(self, spec: PipelineSpec, stage: StageSpec, job_id: str, attempt: int, encoded: CachedOutputs,
              writes: Sequence[Future[JobOutput]]) -> tuple[dict[str, ArtifactRef], list[JobOutput] | None]:
        """The stage's outputs stored, by port, and the job's files begun for results inline once all
        are written (None: none begun, or one failed). A port whose bytes such a file holds as they
        are is that file, not a second copy; if a file failed, it is stored after all (the results
        step will read it)."""
        verbatim = self.assemble_results.verbatim_ports(spec, stage.id) if writes and self.assemble_results else {}
        refs = self._put(job_id, stage, encoded, attempt, [p for p in stage.outputs if p not in verbatim])
        files = _finished(writes)
        if verbatim:
            if files is None:
                refs.update(self._put(job_id, stage, encoded, attempt, list(verbatim)))
            else:
                in_files = {o.name: o.artifact for o in files}
                refs.update({port: in_files[name] for port, name in verbatim.items()})
        return refs, files

    def _put(self, job_id: str, stage: StageSpec, encoded: CachedOutputs, attempt: int,
             ports: Sequence[str]) -> dict[str, ArtifactRef]:
        """Store these of the stage's outputs as intermediates, under the attempt's own keys; their refs by port."""
        if not ports:
            return {}
        items = [(keys.intermediate_artifact(job_id, stage.id, f"{port}.{FORMATS[stage.outputs[port]].extension}", attempt),
                  encoded.data[port], encoded.media_types[port]) for port in ports]
        return dict(zip(ports, self.artifacts.put_intermediates(items), strict=True))
