"""Omni / AsyncOmni: run any pipeline in this process, with no broker and no services.

``Omni("text-to-image").generate({"prompt": "a red fox"})`` runs the same code a deployment runs,
in one process: the JobSubmitter validates the request, the same ledger records every transition,
the same StepExecutor runs each step (stages on the same engines, vLLM and diffusers, with the same
payload formats; the results step writes the same output files). Only the transport and the job
store differ: this object drains the job's outbox itself, in order (instead of a relay publishing
to Celery queues), and jobs live in a MemoryJobStore (instead of Redis). So for the same inputs and seeds, the outputs are the bytes a
queued job produces. Artifacts go where the Settings say (a local directory by default).

``AsyncOmni`` is the same for asyncio code: ``await AsyncOmni(...).generate(...)`` runs the job in a
worker thread; ``stream()`` yields the job's events (progress) as they happen, then the result.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omni_jobs.accept.submission import JobSubmitter
from omni_jobs.artifacts import ArtifactStore, artifact_store_from_settings, codecs
from omni_jobs.core.errors import OmniError
from omni_jobs.core.json_types import JsonValue
from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.scheduling import Scheduler
from omni_jobs.engines.pool import EnginePool
from omni_jobs.engines.stage_exec import load_stage_engine
from omni_jobs.executor import StepExecutor
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.models import Job, JobError, JobEvent, JobOutput, JobStatus, now
from omni_jobs.jobs.store import JobStore
from omni_jobs.media.payloads import AudioClip, VideoClip, decode_payload, encode_payload
from omni_jobs.pipelines.catalogue import PipelineCatalogue, load_catalogue, load_pipeline_file
from omni_jobs.pipelines.model_source import load_model_sources
from omni_jobs.pipelines.spec import PipelineSpec
from omni_jobs.report.results import ResultsAssembler
from omni_jobs.run.stage_attempt import Retries
from omni_jobs.run.stages import StageRunner

if TYPE_CHECKING:
    import PIL.Image
    import torch

EventCallback = Callable[[JobEvent], None]


class OmniJobFailed(OmniError):
    """The in-process job ended without succeeding; ``job`` says where and why."""

    def __init__(self, job: Job) -> None:
        self.job = job
        error = job.error
        where = f" in stage '{error.stage}'" if error and error.stage else ""
        reason = f": {error.type}: {error.message}" if error else ""
        super().__init__(f"job {job.id} ({job.pipeline}) {job.status.value}{where}{reason}")


@dataclass(frozen=True)
class OmniOutput:
    """One final output: its manifest entry and the bytes of its file."""

    entry: JobOutput
    data: bytes

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def type(self) -> str:
        return self.entry.type

    @property
    def text(self) -> str | None:
        return self.entry.text

    def json(self) -> JsonValue:
        document: JsonValue = codecs.decode_json(self.data)
        return document

    def image(self) -> PIL.Image.Image:
        """The image of an image output, or of a text+image bundle."""
        if self.type == "text+image":
            document = self.json()
            image = document.get("image") if isinstance(document, dict) else None
            data = image.get("data") if isinstance(image, dict) else None
            if not isinstance(data, str):
                raise codecs.CodecError(f"output '{self.name}' holds no base64 image data")
            return codecs.decode_png(base64.b64decode(data))
        return codecs.decode_png(self.data)

    def audio(self) -> AudioClip:
        return decode_payload("audio", self.data)

    def video(self) -> VideoClip:
        """The frames (uint8 [n, height, width, 3]) and frame rate of a video output (its MP4 decoded)."""
        return decode_payload("video", self.data)

    def tensor(self) -> torch.Tensor:
        (tensor,) = codecs.decode_tensors(self.data).values()
        return tensor


@dataclass(frozen=True)
class OmniResult:
    """A finished job and its outputs by name."""

    job: Job
    outputs: dict[str, OmniOutput]

    def __getitem__(self, name: str) -> OmniOutput:
        return self.outputs[name]


def _image_value(value: object) -> object:
    """A file input: in-process callers may also pass a PIL image, an AudioClip, a VideoClip or a file
    path; the API's forms (bytes, base64, references) pass through."""
    from PIL import Image

    if isinstance(value, Path):
        return value.read_bytes()
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        (value if value.mode in ("RGB", "RGBA", "L") else value.convert("RGB")).save(buffer, format="PNG")
        return buffer.getvalue()
    if isinstance(value, AudioClip | VideoClip):
        return encode_payload("audio" if isinstance(value, AudioClip) else "video", value)
    return value


class Omni:
    """Runs one pipeline in this process. Several instances may share engines, store and artifacts."""

    def __init__(
        self,
        pipeline: str | Path | PipelineSpec,
        *,
        settings: Settings | None = None,
        engines: EnginePool | None = None,
        store: JobStore | None = None,
        artifacts: ArtifactStore | None = None,
        worker: str | None = None,
    ) -> None:
        """``pipeline``: a catalogue name (built-in or under OMNI_PIPELINES_PATH), a YAML file, or a spec."""
        self.settings = settings or Settings()
        s = self.settings
        load_model_sources(s.model_sources)  # tiny:NAME ids (OMNI_MODEL_SOURCES), before the pipeline is validated
        if isinstance(pipeline, PipelineSpec):
            self.spec = pipeline
        elif isinstance(pipeline, Path) or str(pipeline).endswith((".yaml", ".yml")):
            self.spec = load_pipeline_file(Path(pipeline))
        else:
            self.spec = load_catalogue(s.pipelines_path).get(str(pipeline))
        self.catalogue = PipelineCatalogue([self.spec])
        self.store: JobStore = store if store is not None else MemoryJobStore(ttl_s=s.output_ttl_s)
        self.ledger = JobLedger(self.store, lease_s=s.lease_s, max_attempts=1 + s.stage_max_retries)
        self.artifacts = artifacts if artifacts is not None else artifact_store_from_settings(s)
        self.engines = engines or EnginePool(
            s.models_dir, kv_cache_bytes=s.ar_kv_cache_bytes, max_model_len=s.ar_max_model_len, device=s.device
        )
        self.worker = worker or f"omni@{socket.gethostname()}:{os.getpid()}"
        self.owner = f"{self.worker}#{os.getpid()}"
        retries = Retries(backoff_s=s.stage_retry_backoff_s)
        self.runner = StageRunner(ledger=self.ledger, catalogue=self.catalogue, artifacts=self.artifacts,
                                  engines=self.engines, retries=retries)
        self.results = ResultsAssembler(ledger=self.ledger, catalogue=self.catalogue, artifacts=self.artifacts,
                                        retries=retries)
        self.executor = StepExecutor(self.runner, self.results)

    def load(self) -> Omni:
        """Load every stage's engine now (else each loads on first use); returns self."""
        for stage in self.spec.stages:
            load_stage_engine(self.engines, stage)
        return self

    def generate(self, inputs: Mapping[str, object], params: Mapping[str, Mapping[str, JsonValue]] | None = None, *,
                 on_event: EventCallback | None = None) -> OmniResult:
        """Run one job to the end; OmniJobFailed if it fails, InvalidRequest if the request is bad.

        ``params``: per-stage overrides, validated and recorded on the job as the API does.
        ``on_event``: called with each of the job's events (stage started, progress, ...) as it happens.
        """
        values = {k: _image_value(v) if k in self.spec.file_inputs() else v for k, v in inputs.items()}
        submitter = JobSubmitter(self.ledger, self.catalogue, artifacts=self.artifacts, webhooks_enabled=False)
        listener = self._forward_events(on_event) if on_event is not None else None
        if listener is not None:
            self.ledger.listeners.append(listener)
        try:
            job = submitter.submit(self.spec.name, values, dict(params or {}))
            self._drain(job.id)
        finally:
            if listener is not None:
                self.ledger.listeners.remove(listener)
        final = self.ledger.require(job.id)
        if final.status is not JobStatus.succeeded:
            raise OmniJobFailed(final)
        return OmniResult(final, {o.name: OmniOutput(o, self.artifacts.get(o.artifact)) for o in final.outputs})

    def _drain(self, job_id: str) -> None:
        """Run the job's steps as they become due, in this thread: what the relay and the workers do."""
        scheduler = Scheduler(self.store, None)  # one process: every ready stage is released at once
        while True:
            scheduler.release_all()
            entries = self.store.claim_outbox(now=now(), limit=16, hold_s=3600.0, job_id=job_id)
            if not entries:
                job = self.ledger.require(job_id)
                if job.status.is_final:
                    return
                time.sleep(0.01)  # a step backing off after a transient error becomes due later
                continue
            for entry in entries:
                try:
                    self.executor.execute(entry.step, worker=self.worker, owner=self.owner)
                except Exception as exc:
                    self.ledger.fail(job_id, JobError(stage=getattr(entry.step, "stage_id", None),
                                                      type=type(exc).__name__, message=str(exc) or repr(exc)))
                    raise OmniJobFailed(self.ledger.require(job_id)) from exc
                finally:
                    self.store.ack_outbox([entry.id])

    @staticmethod
    def _forward_events(on_event: EventCallback) -> Callable[[Job, list[JobEvent]], None]:
        """A store listener that passes on the events made by this thread: every change of an
        in-process job happens in the thread that runs it, and only its changes happen there."""
        thread = threading.get_ident()

        def listener(job: Job, events: list[JobEvent]) -> None:
            if threading.get_ident() == thread:
                for event in events:
                    on_event(event)

        return listener


class AsyncOmni:
    """Omni for asyncio callers: jobs run in worker threads, so the event loop stays free."""

    def __init__(self, pipeline: str | Path | PipelineSpec, *, settings: Settings | None = None,
                 engines: EnginePool | None = None, store: JobStore | None = None,
                 artifacts: ArtifactStore | None = None, worker: str | None = None) -> None:
        """As ``Omni``."""
        self.omni = Omni(pipeline, settings=settings, engines=engines, store=store, artifacts=artifacts, worker=worker)

    async def load(self) -> AsyncOmni:
        await asyncio.to_thread(self.omni.load)
        return self

    async def generate(self, inputs: Mapping[str, object], params: Mapping[str, Mapping[str, JsonValue]] | None = None, *,
                       on_event: EventCallback | None = None) -> OmniResult:
        return await asyncio.to_thread(self.omni.generate, inputs, params, on_event=on_event)

    async def stream(self, inputs: Mapping[str, object],
                     params: Mapping[str, Mapping[str, JsonValue]] | None = None) -> AsyncIterator[JobEvent | OmniResult]:
        """The job's events as they happen; the last item is the OmniResult (errors are raised)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[JobEvent] = asyncio.Queue()

        def forward(event: JobEvent) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        task = asyncio.ensure_future(self.generate(inputs, params, on_event=forward))
        while not task.done() or not queue.empty():
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
            else:
                getter.cancel()
        yield task.result()

