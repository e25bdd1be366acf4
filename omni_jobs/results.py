"""The results step: the multimodal output processor that turns stage outputs into final files.

One handler per modality writes a standard file (JSON text, PNG, WAV, safetensors) under
``jobs/{id}/outputs/`` and describes it in the job's manifest. It runs once in effect: a job that
already ended is left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from omni_jobs import keys
from omni_jobs.artifacts import ArtifactRef, ArtifactStore, codecs
from omni_jobs.jobs import state
from omni_jobs.jobs.models import Job, JobEvent, JobOutput, now
from omni_jobs.jobs.store import JobStore
from omni_jobs.payloads import FORMATS, decode_payload
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.modalities import Modality

log = logging.getLogger(__name__)

OutputHandler = Callable[[ArtifactStore, str, str, bytes], JobOutput]
"""(store, job id, output name, stage payload bytes) -> the manifest entry of the written file."""


def _write(store: ArtifactStore, job_id: str, name: str, modality: Modality, data: bytes) -> ArtifactRef:
    fmt = FORMATS[modality]
    return store.put_output(keys.output_artifact(job_id, f"{name}.{fmt.extension}"), data, fmt.media_type)


def text_output(store: ArtifactStore, job_id: str, name: str, data: bytes) -> JobOutput:
    text = decode_payload("text", data)
    ref = _write(store, job_id, name, "text", codecs.encode_json({"text": text}))
    return JobOutput(name=name, type="text", media_type=ref.media_type, size=ref.size, artifact=ref, text=text)


def image_output(store: ArtifactStore, job_id: str, name: str, data: bytes) -> JobOutput:
    info = codecs.png_info(data)
    ref = _write(store, job_id, name, "image", data)
    return JobOutput(
        name=name, type="image", media_type=ref.media_type, size=ref.size, artifact=ref,
        width=info["width"], height=info["height"],
    )


def tensor_output(modality: Modality) -> OutputHandler:
    def handle(store: ArtifactStore, job_id: str, name: str, data: bytes) -> JobOutput:
        ref = _write(store, job_id, name, modality, data)
        return JobOutput(name=name, type=modality, media_type=ref.media_type, size=ref.size, artifact=ref)

    return handle


OUTPUT_HANDLERS: dict[Modality, OutputHandler] = {
    "text": text_output,
    "image": image_output,
    "token_ids": tensor_output("token_ids"),
    "hidden_states": tensor_output("hidden_states"),
    "prompt_embeds": tensor_output("prompt_embeds"),
    "latents": tensor_output("latents"),
}


class ResultsAssembler:
    def __init__(self, *, store: JobStore, catalogue: PipelineCatalogue, artifacts: ArtifactStore) -> None:
        self.store = store
        self.catalogue = catalogue
        self.artifacts = artifacts

    def assemble(self, job_id: str) -> Job | None:
        job = self.store.get(job_id)
        if job is None or job.status.is_final:
            return job
        spec = self.catalogue.get(job.pipeline)
        outputs: list[JobOutput] = []
        for out in spec.outputs:
            stage = spec.stage(out.source.source)
            modality = stage.outputs[out.source.port]
            ref = job.stage_record(stage.id).outputs[out.source.port]
            handler = OUTPUT_HANDLERS[modality]
            outputs.append(handler(self.artifacts, job_id, out.name, self.artifacts.get(ref)))

        def mutate(j: Job) -> list[JobEvent]:
            if j.status.is_final:
                return []
            j.outputs = outputs
            return state.job_succeeded(j, now())

        job, _ = self.store.update(job_id, mutate)
        log.info("job %s succeeded with outputs %s", job_id, [o.name for o in outputs])
        return job
