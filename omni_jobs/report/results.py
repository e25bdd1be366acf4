"""The results step: the multimodal output processor that turns stage outputs into final files.

One handler per output type (text, image, audio, video, each tensor modality, and the text+image
bundle) writes a standard file (JSON, PNG, WAV, MP4, safetensors) under ``jobs/{id}/outputs/`` and
describes it in the job's manifest: name, type, media type, size, and what a client needs before
downloading (the text itself; an image's width and height; a clip's duration and sample rate; a
video's frames, fps, duration, width and height; a tensor's shape). It runs once in effect: it holds a lease like a stage, and a job that ended is left alone.

Each attempt that writes a job's files writes them under keys of its own (``writer_of``): the first
attempt of the last stage (results inline) under ``jobs/{id}/outputs/``, any other under
``jobs/{id}/outputs/<its attempt>/``. The files are written before the lease-checked write that
records them, so a stale attempt (one whose lease was taken back while it worked) still writes; under
shared keys it replaced the files of the job that had succeeded meanwhile, whose recorded checksums
then failed every download. Now it writes files no job names. Once a job has succeeded from another
attempt than the first, the files of the attempts that lost are deleted (``sweep``).
"""

from __future__ import annotations

import base64
import contextvars
import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Protocol, TypeVar

from omni_jobs.artifacts import ArtifactRef, ArtifactStore, codecs, mp4
from omni_jobs.core import keys
from omni_jobs.dispatch.leases import LeaseKeeper
from omni_jobs.jobs.ledger import JobLedger, Lease, Refused
from omni_jobs.jobs.models import EventType, Job, JobEvent, JobOutput
from omni_jobs.jobs.steps import AssembleResults, StepOutcome
from omni_jobs.media.payloads import FORMATS, SAFETENSORS, PayloadFormat, decode_payload
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.modalities import OUTPUT_TYPES, TENSOR_MODALITIES, Modality
from omni_jobs.pipelines.spec import OutputSpec, PipelineSpec
from omni_jobs.run.stage_attempt import TRANSIENT_ERRORS, Retries, job_error
from omni_jobs.run.stage_outputs import EarlyOutputs

log = logging.getLogger(__name__)
T = TypeVar("T")


@functools.cache
def _writers() -> ThreadPoolExecutor:
    """The threads that write a job's outputs side by side (one pool per process, made on first use)."""
    return ThreadPoolExecutor(max_workers=8, thread_name_prefix="omni-outputs")

class OutputHandler(Protocol):
    """(store, job id, output name, the stage payloads it is made of, the writing attempt) -> the
    manifest entry of the written file."""

    def __call__(self, store: ArtifactStore, job_id: str, name: str, parts: Sequence[bytes],
                 writer: str | None = None) -> JobOutput: ...


def writer_of(job: Job, fresh: Mapping[tuple[str, str], bytes] | None) -> str | None:
    """Whose keys a write of ``job``'s files uses: None for the first attempt of its last stage (results
    inline, from that stage's ``fresh`` bytes), ``<stage>.<attempt>`` for a later attempt of it, and
    ``results-<attempt>`` for the results step. A stage id never holds a '.', so the two never meet."""
    stages = {stage for stage, _port in fresh or {}}
    if len(stages) == 1:
        (stage,) = stages
        attempt = job.stage_record(stage).attempts
        return None if attempt <= 1 else f"{stage}.{attempt}"
    return f"results-{job.results.attempts}"


def _writer_in(key: str, job_id: str) -> str | None:
    """The writer part of an output file's key (the inverse of keys.output_artifact)."""
    rest = key.removeprefix(keys.output_artifact(job_id, ""))
    return rest.split("/", 1)[0] if "/" in rest else None


def _write(store: ArtifactStore, job_id: str, name: str, fmt: PayloadFormat, data: bytes,
           writer: str | None = None) -> ArtifactRef:
    return store.put_output(keys.output_artifact(job_id, f"{name}.{fmt.extension}", writer), data, fmt.media_type)


def _entry(name: str, type_: str, ref: ArtifactRef, **fields: object) -> JobOutput:
    return JobOutput(name=name, type=type_, media_type=ref.media_type, size=ref.size, artifact=ref, **fields)


def text_output(store: ArtifactStore, job_id: str, name: str, parts: Sequence[bytes],
                writer: str | None = None) -> JobOutput:
    """``{"text": ...}`` as JSON; the manifest carries the text too."""
    text = decode_payload("text", parts[0])
    ref = _write(store, job_id, name, FORMATS["text"], codecs.encode_json({"text": text}), writer)
    return _entry(name, "text", ref, text=text)


def image_output(store: ArtifactStore, job_id: str, name: str, parts: Sequence[bytes],
                 writer: str | None = None) -> JobOutput:
    """The PNG as the stage wrote it, with its width and height."""
    info = codecs.png_info(parts[0])
    ref = _write(store, job_id, name, FORMATS["image"], parts[0], writer)
    return _entry(name, "image", ref, width=info["width"], height=info["height"])


def audio_output(store: ArtifactStore, job_id: str, name: str, parts: Sequence[bytes],
                 writer: str | None = None) -> JobOutput:
    """The WAV as the stage wrote it, with its duration and sample rate."""
    info = codecs.wav_info(parts[0])
    ref = _write(store, job_id, name, FORMATS["audio"], parts[0], writer)
    return _entry(name, "audio", ref, duration_s=info["duration_s"], sample_rate=info["sample_rate"])


def video_output(store: ArtifactStore, job_id: str, name: str, parts: Sequence[bytes],
                 writer: str | None = None) -> JobOutput:
    """The MP4 (H.264) as the stage wrote it, with its frames, fps, duration, width and height."""
    info = mp4.mp4_info(parts[0])
    ref = _write(store, job_id, name, FORMATS["video"], parts[0], writer)
    return _entry(name, "video", ref, frames=info["frames"], fps=info["fps"], duration_s=info["duration_s"],
                  width=info["width"], height=info["height"])


def tensor_output(modality: Modality) -> OutputHandler:
    """A tensor (latents, hidden states, ...) as safetensors, with its shape."""

    def handle(store: ArtifactStore, job_id: str, name: str, parts: Sequence[bytes],
               writer: str | None = None) -> JobOutput:
        tensor = codecs.decode_tensors(parts[0])[modality]
        ref = _write(store, job_id, name, SAFETENSORS, parts[0], writer)
        return _entry(name, modality, ref, shape=list(tensor.shape))

    return handle


def text_and_image_output(store: ArtifactStore, job_id: str, name: str, parts: Sequence[bytes],
                          writer: str | None = None) -> JobOutput:
    """One self-contained JSON document: the text and the PNG (base64) that belong together."""
    text = decode_payload("text", parts[0])
    png = parts[1]
    info = codecs.png_info(png)
    document = {
        "text": text,
        "image": {"media_type": codecs.MEDIA_PNG, "width": info["width"], "height": info["height"],
                  "data": base64.b64encode(png).decode("ascii")},
    }
    ref = _write(store, job_id, name, FORMATS["text"], codecs.encode_json(document), writer)
    return _entry(name, "text+image", ref, text=text, width=info["width"], height=info["height"])


VERBATIM_TYPES = frozenset({"image", "audio", "video", *TENSOR_MODALITIES})
"""Output types whose file holds its stage output's bytes unchanged (their handlers add nothing)."""

OUTPUT_HANDLERS: dict[str, OutputHandler] = {
    "text": text_output,
    "image": image_output,
    "audio": audio_output,
    "video": video_output,
    **{m: tensor_output(m) for m in sorted(TENSOR_MODALITIES)},
    "text+image": text_and_image_output,
}
assert set(OUTPUT_HANDLERS) == set(OUTPUT_TYPES), "every output type a pipeline may declare needs a handler"


class ResultsAssembler:
    """Runs the results step: takes its lease, writes the final files, ends the job succeeded.

    Each attempt writes under keys of its own (``writer_of``), and once the job has succeeded from
    an attempt other than the first, the files of the others are deleted (``sweep``): one file per
    output, whoever wrote it, and none that a stale attempt can replace.
    """

    def __init__(self, *, ledger: JobLedger, catalogue: PipelineCatalogue, artifacts: ArtifactStore,
                 keeper: LeaseKeeper | None = None, retries: Retries | None = None) -> None:
        """``retries``: the stages' own backoff and store wait (OMNI_STAGE_RETRY_BACKOFF_S, OMNI_STORE_WAIT_S)."""
        self.ledger = ledger
        self.catalogue = catalogue
        self.artifacts = artifacts
        self.keeper = keeper
        self.retries = retries or Retries()
        ledger.listeners.append(self._on_events)  # whichever write ends a job succeeded, in this process

    def _on_events(self, job: Job, events: Sequence[JobEvent]) -> None:
        if any(e.type is EventType.job_succeeded for e in events):
            self.sweep(job)

    def sweep(self, job: Job) -> list[str]:
        """Delete the files that attempts other than the recorded one may have written for ``job``
        (killed while writing, or refused); the keys it deleted, or found absent. Nothing to do, and no
        call made, when the job's files are the first attempt's of its last stage, as nearly always."""
        if not job.outputs or (winner := _writer_in(job.outputs[0].artifact.key, job.id)) is None:
            return []
        writers: set[str | None] = {None, *(f"results-{n}" for n in range(1, job.results.attempts + 1))}
        writers |= {f"{r.id}.{n}" for r in job.stages for n in range(2, r.attempts + 1)}
        writers.discard(winner)
        names = sorted({o.artifact.key.rsplit("/", 1)[1] for o in job.outputs})
        swept = [keys.output_artifact(job.id, name, writer) for writer in writers for name in names]
        for key in swept:
            try:
                self.artifacts.large.delete(key)  # absent: nothing happens
            except Exception:  # a file left over is only space: retention deletes the job's
                log.warning("job %s: could not delete %s", job.id, key, exc_info=True)
        log.info("job %s: its files are %s's; deleted those other attempts may have left", job.id, winner)
        return swept

    def run(self, step: AssembleResults, *, worker: str, owner: str) -> StepOutcome:
        where = f"job {step.job_id} results attempt {step.attempt}"
        taken = self.retries.patiently(lambda: self.ledger.acquire(step, worker=worker, owner=owner), where)
        if isinstance(taken, Refused):
            return StepOutcome("skipped", taken.reason)
        return self.run_held(taken.job, taken.lease)

    def run_held(self, job: Job, lease: Lease, early: EarlyOutputs | None = None) -> StepOutcome:
        """Write the outputs of a job whose results lease this process holds already: after
        ``acquire``, or inline in the worker whose stage completed the job (``complete_stage``'s
        ``results_worker``), which may have begun them (``early``)."""
        where = f"job {job.id} results attempt {lease.attempt}"
        lost = threading.Event()
        if self.keeper is None:
            return self._assemble(job, lease, lost, where, early)
        with self.keeper.hold(lease, on_lost=lost.set):
            return self._assemble(job, lease, lost, where, early)

    def _assemble(self, job: Job, lease: Lease, lost: threading.Event, where: str,
                  early: EarlyOutputs | None) -> StepOutcome:
        try:
            outputs = self._early_outputs(job, early) if early is not None else None
            if outputs is None:
                outputs = self.write_outputs(job)
        except TRANSIENT_ERRORS as exc:
            delay = self.retries.delay(lease.attempt)
            error = job_error("results", exc)
            outcome = self.retries.patiently(lambda: self.ledger.retry_later(lease, error, delay), where)
            log.warning("%s: transient error (%s: %s); %s", where, type(exc).__name__, exc, outcome)
            return StepOutcome(outcome, str(exc))
        except Exception as exc:  # any other error fails the job, with its reason recorded
            failure = job_error(None, exc)
            self.retries.patiently(lambda: self.ledger.fail(job.id, failure, lease=lease), where)
            log.exception("%s failed", where)
            return StepOutcome("failed", str(exc))
        if lost.is_set():
            return StepOutcome("lost", "the lease was taken back while writing the outputs")
        done = self.retries.patiently(lambda: self.ledger.complete_results(lease, outputs, snapshot=job), where)
        if isinstance(done, Refused):
            return StepOutcome("discarded", done.reason)
        log.info("job %s succeeded with outputs %s", job.id, [o.name for o in outputs])
        return StepOutcome("succeeded")

    def write_outputs(self, job: Job) -> list[JobOutput]:
        """Each declared output of the pipeline, written as its file, with its manifest entry.

        Several outputs are written at once: each write waits for its storage (an fsync on local
        disk, ~1.4 ms here; an upload to S3), and those waits overlap (bench --hops: a two-output
        job's last stage -> results done); a lone one on this thread (``start_outputs``). The first
        error is raised once all have ended."""
        running = self.start_outputs(job)
        wait(running)  # all ended before an error is raised: no write outlives its attempt
        return [f.result() for f in running]

    def start_outputs(self, job: Job, fresh: Mapping[tuple[str, str], bytes] | None = None) -> list[Future[JobOutput]]:
        """Begin writing each declared output of ``job`` on the writer threads, in the pipeline's order;
        a lone output is written on this thread (no handoff: DiT 32px small, paired, 1.034 of the pool
        and 3% less worker CPU), its future already done.
        ``fresh``: the bytes of the (stage, port) outputs to use as they are instead of reading them
        from the store: the last stage's own, handed over before they are stored (results inline)."""
        spec = self.catalogue.get(job.pipeline)
        writer = writer_of(job, fresh)
        if len(spec.outputs) == 1:  # nothing to write beside it: on this thread, without a handoff
            written: Future[JobOutput] = Future()
            try:
                written.set_result(self._write_output(spec, job, spec.outputs[0], fresh or {}, writer))
            except Exception as exc:  # noqa: BLE001 - handed over in the future, as from the writer threads
                written.set_exception(exc)
            return [written]
        return [_writers().submit(contextvars.copy_context().run, self._write_output, spec, job, out, fresh or {},
                                  writer)
                for out in spec.outputs]

    def _write_output(self, spec: PipelineSpec, job: Job, out: OutputSpec,
                      fresh: Mapping[tuple[str, str], bytes], writer: str | None) -> JobOutput:
        parts = [fresh[(s.source, s.port)] if (s.source, s.port) in fresh
                 else self.artifacts.get(job.stage_record(s.source).outputs[s.port]) for s in out.sources]
        return OUTPUT_HANDLERS[spec.output_type(out)](self.artifacts, job.id, out.name, parts, writer)

    @staticmethod
    def verbatim_ports(spec: PipelineSpec, stage_id: str) -> dict[str, str]:
        """The ports of ``stage_id`` whose bytes an output's file holds as they are (an image, a clip,
        a tensor: written as the stage wrote it), port -> output name. Results inline, that file is
        the port's stored copy: the stage's output is not stored a second time."""
        return {out.sources[0].port: out.name for out in spec.outputs
                if len(out.sources) == 1 and out.sources[0].source == stage_id
                and spec.output_type(out) in VERBATIM_TYPES}

    @staticmethod
    def _early_outputs(job: Job, early: EarlyOutputs) -> list[JobOutput] | None:
        """The outputs begun before the job's last stage was recorded, if they were made of the stage
        outputs ``job`` has and were all written; else None (written again, errors handled as usual)."""
        wait(early.writes)
        if early.made_from != [r.outputs for r in job.stages] or any(f.exception() for f in early.writes):
            return None
        return [f.result() for f in early.writes]
