"""The results step: the multimodal output processor that turns stage outputs into final files.

One handler per output type (text, image, audio, each tensor modality, and the text+image bundle)
writes a standard file (JSON, PNG, WAV, safetensors) under ``jobs/{id}/outputs/`` and describes it
in the job's manifest: name, type, media type, size, and what a client needs before downloading
(the text itself; an image's width and height; a clip's duration and sample rate; a tensor's
shape). It runs once in effect: a job that already ended is left alone.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Sequence

from omni_jobs import keys
from omni_jobs.artifacts import ArtifactRef, ArtifactStore, codecs
from omni_jobs.jobs import state
from omni_jobs.jobs.models import Job, JobEvent, JobOutput, now
from omni_jobs.jobs.store import JobStore
from omni_jobs.payloads import FORMATS, SAFETENSORS, PayloadFormat
from omni_jobs.pipelines.catalogue import PipelineCatalogue
from omni_jobs.pipelines.modalities import OUTPUT_TYPES, TENSOR_MODALITIES, Modality

log = logging.getLogger(__name__)

OutputHandler = Callable[[ArtifactStore, str, str, Sequence[bytes]], JobOutput]
"""(store, job id, output name, the stage payloads it is made of) -> the manifest entry of the written file."""


def _write(store: ArtifactStore, job_id: str, name: str, fmt: PayloadFormat, data: bytes) -> ArtifactRef:
    return store.put_output(keys.output_artifact(job_id, f"{name}.{fmt.extension}"), data, fmt.media_type)


def _entry(name: str, type_: str, ref: ArtifactRef, **fields: object) -> JobOutput:
    return JobOutput(name=name, type=type_, media_type=ref.media_type, size=ref.size, artifact=ref, **fields)


def text_output(store: ArtifactStore, job_id: str, name: str, parts: Sequence[bytes]) -> JobOutput:
    """``{"text": ...}`` as JSON; the manifest carries the text too."""
    text = str(codecs.decode_json(parts[0])["text"])
    ref = _write(store, job_id, name, FORMATS["text"], codecs.encode_json({"text": text}))
    return _entry(name, "text", ref, text=text)


def image_output(store: ArtifactStore, job_id: str, name: str, parts: Sequence[bytes]) -> JobOutput:
    """The PNG as the stage wrote it, with its width and height."""
    info = codecs.png_info(parts[0])
    ref = _write(store, job_id, name, FORMATS["image"], parts[0])
    return _entry(name, "image", ref, width=info["width"], height=info["height"])


def audio_output(store: ArtifactStore, job_id: str, name: str, parts: Sequence[bytes]) -> JobOutput:
    """The WAV as the stage wrote it, with its duration and sample rate."""
    info = codecs.wav_info(parts[0])
    ref = _write(store, job_id, name, FORMATS["audio"], parts[0])
    return _entry(name, "audio", ref, duration_s=info["duration_s"], sample_rate=info["sample_rate"])


def tensor_output(modality: Modality) -> OutputHandler:
    """A tensor (latents, hidden states, ...) as safetensors, with its shape."""

    def handle(store: ArtifactStore, job_id: str, name: str, parts: Sequence[bytes]) -> JobOutput:
        tensor = codecs.decode_tensors(parts[0])[modality]
        ref = _write(store, job_id, name, SAFETENSORS, parts[0])
        return _entry(name, modality, ref, shape=list(tensor.shape))

    return handle


def text_and_image_output(store: ArtifactStore, job_id: str, name: str, parts: Sequence[bytes]) -> JobOutput:
    """One self-contained JSON document: the text and the PNG (base64) that belong together."""
    text = str(codecs.decode_json(parts[0])["text"])
    png = parts[1]
    info = codecs.png_info(png)
    document = {
        "text": text,
        "image": {"media_type": codecs.MEDIA_PNG, "width": info["width"], "height": info["height"],
                  "data": base64.b64encode(png).decode("ascii")},
    }
    ref = _write(store, job_id, name, FORMATS["text"], codecs.encode_json(document))
    return _entry(name, "text+image", ref, text=text, width=info["width"], height=info["height"])


OUTPUT_HANDLERS: dict[str, OutputHandler] = {
    "text": text_output,
    "image": image_output,
    "audio": audio_output,
    **{m: tensor_output(m) for m in sorted(TENSOR_MODALITIES)},
    "text+image": text_and_image_output,
}
assert set(OUTPUT_HANDLERS) == set(OUTPUT_TYPES), "every output type a pipeline may declare needs a handler"


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
            parts = [self.artifacts.get(job.stage_record(s.source).outputs[s.port]) for s in out.sources]
            outputs.append(OUTPUT_HANDLERS[spec.output_type(out)](self.artifacts, job_id, out.name, parts))

        def mutate(j: Job) -> list[JobEvent]:
            if j.status.is_final:
                return []
            j.outputs = outputs
            return state.job_succeeded(j, now())

        job, _ = self.store.update(job_id, mutate)
        log.info("job %s succeeded with outputs %s", job_id, [o.name for o in outputs])
        return job
