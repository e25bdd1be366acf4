"""Finished jobs as OpenAI's answers, as pure functions (no HTTP; text_meta reads through the function it
is given): a chat completion, images, a model card, and streamed speech's pieces and events. A job that
failed, was canceled or is still running is an OpenAIError (``finished``)."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Mapping
from typing import Literal

import numpy as np

from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.accept.openai_requests import Plan, output_modalities, text_source
from omni_jobs.artifacts.codecs import CodecError
from omni_jobs.artifacts.refs import ArtifactRef
from omni_jobs.core.json_types import JsonObject, JsonValue
from omni_jobs.jobs.models import Job, JobOutput, JobStatus
from omni_jobs.media.audio_formats import PCM_RATE, pcm16
from omni_jobs.pipelines.spec import PipelineSpec
from omni_jobs.run.audio_stream import AudioChunk


def finished(submitted: list[Job], done: list[Job | None], *, wait_s: float) -> list[Job]:
    """The jobs as they ended (``done``: each one after waiting up to ``wait_s``, None if gone), or the
    first one's failure, cancellation or timeout as an OpenAIError (not retried: it would start a job)."""
    ids = [job.id for job in submitted]
    jobs: list[Job] = []
    for before, job in zip(submitted, done, strict=True):
        if job is None:
            raise OpenAIError(500, f"job {before.id} disappeared (expired?)", type_="server_error",
                              code="job_gone", job_ids=ids, retry=False)
        if job.status is JobStatus.failed:
            error = job.error
            where = f" in stage '{error.stage}'" if error and error.stage else ""
            raise OpenAIError(500, f"job {job.id} failed{where}: {error.message if error else 'unknown error'}",
                              type_="server_error", code="job_failed", job_ids=ids, retry=False)
        if job.status is JobStatus.canceled:
            raise OpenAIError(500, f"job {job.id} was canceled", type_="server_error", code="job_canceled",
                              job_ids=ids, retry=False)
        if not job.status.is_final:
            raise OpenAIError(504, f"job {job.id} is still {job.status.value} after {wait_s:g}s (OMNI_OPENAI_WAIT_S); "
                              f"follow it at GET /v1/jobs/{job.id}", type_="timeout", code="job_timeout",
                              job_ids=ids, retry=False)
        jobs.append(job)
    return jobs


def outputs_of(job: Job, modality: str) -> list[JobOutput]:
    return [o for o in job.outputs if o.type == modality]


def first_output(job: Job, modality: str) -> JobOutput:
    found = outputs_of(job, modality)
    if not found:
        raise OpenAIError(500, f"job {job.id} succeeded without an {modality} output", type_="server_error",
                          code="missing_output", job_ids=[job.id], retry=False)
    return found[0]


def text_of(job: Job) -> str | None:
    texts = outputs_of(job, "text")
    return texts[0].text if texts else None


def needed_outputs(job: Job, wanted: list[str]) -> list[JobOutput]:
    """The outputs whose bytes a chat answer carries (images, the audio), fetched by the caller."""
    needed = list(outputs_of(job, "image")) if "image" in wanted else []
    if "audio" in wanted:
        needed.append(first_output(job, "audio"))
    return needed


def reported_text_meta(document: JsonValue) -> tuple[str | None, dict[str, int] | None]:
    """(finish_reason, usage) as the AR engine reported them in its text document (None, None when it did not:
    a stage output kept from before it did, in the stage-output cache); CodecError if it is no JSON object."""
    if not isinstance(document, dict):
        raise CodecError(f"a text payload is a JSON object, got {type(document).__name__}")
    usage: dict[str, int] | None = None
    reported = document.get("usage")
    if isinstance(reported, dict):
        prompt, completion = reported.get("prompt_tokens"), reported.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    finish = document.get("finish_reason")
    return (finish if isinstance(finish, str) else None), usage


def finish_by_length(tokens: int, max_tokens: object) -> str:
    """The finish_reason of a text whose engine did not report one: 'length' when it made max_tokens tokens."""
    return "length" if isinstance(max_tokens, int | float) and tokens >= int(max_tokens) else "stop"


def text_meta(spec: PipelineSpec, job: Job,
              read: Callable[[ArtifactRef], bytes]) -> tuple[str, dict[str, int] | None]:
    """(finish_reason, usage) of the chat's text answer, as the AR engine reported them beside its text (``read``:
    an artifact's bytes; blocking). A stage output written before the engine reported them (kept in the
    stage-output cache) has neither: then 'length' when the stage made max_tokens tokens, else 'stop', and no
    usage."""
    from omni_jobs.artifacts import codecs
    from omni_jobs.media.payloads import decode_payload

    source = text_source(spec)
    if source is None:
        return "stop", None
    stage_id, port = source
    ref = job.stage_record(stage_id).outputs.get(port)
    if ref is None:
        return "stop", None
    finish, usage = reported_text_meta(codecs.decode_json(read(ref)))
    if finish is not None:
        return finish, usage
    tokens_ref = job.stage_record(stage_id).outputs.get("token_ids")
    max_tokens = job.params.get(stage_id, {}).get("max_tokens")
    if tokens_ref is None or max_tokens is None:
        return "stop", usage
    return finish_by_length(len(decode_payload("token_ids", read(tokens_ref))), max_tokens), usage


def chat_completion(plan: Plan, job: Job, *, finish: str, usage: dict[str, int] | None,
                    data: Mapping[str, bytes], output_ttl_s: int) -> JsonObject:
    """The chat.completion body: one choice per asked modality. ``data``: output name -> its bytes."""
    text = text_of(job)
    choices: list[JsonValue] = []
    for index, modality in enumerate(plan.wanted):
        message: JsonObject = {"role": "assistant", "content": None}
        if modality == "text":
            message["content"] = text or ""
        elif modality == "image":
            message["content"] = [
                {"type": "image_url",
                 "image_url": {"url": f"data:{out.media_type};base64,{base64.b64encode(data[out.name]).decode('ascii')}"}}
                for out in outputs_of(job, "image")]
        else:
            out = first_output(job, "audio")
            message["audio"] = {
                "id": f"audio_{job.id}",
                "data": base64.b64encode(data[out.name]).decode("ascii"),
                "expires_at": int(job.completed_at or time.time()) + output_ttl_s,
                "transcript": text or "",
            }
        choices.append({"index": index, "message": message, "finish_reason": finish if modality == "text" else "stop",
                        "logprobs": None})
    return {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": int(job.created_at),
            "model": plan.spec.name, "choices": choices, "usage": {**usage} if usage is not None else None,
            "system_fingerprint": None}


def image_items(job: Job, response_format: str | None, *, data: Mapping[str, bytes] | None = None,
                urls: Mapping[str, str] | None = None) -> list[JsonObject]:
    """The ``data`` entries of one job's images: ``b64_json`` from ``data`` or ``url`` from ``urls``."""
    revised = text_of(job)
    items: list[JsonObject] = []
    for out in outputs_of(job, "image"):
        item: JsonObject = {}
        if response_format == "url":
            assert urls is not None
            item["url"] = urls[out.name]
        else:
            assert data is not None
            item["b64_json"] = base64.b64encode(data[out.name]).decode("ascii")
        if revised is not None:
            item["revised_prompt"] = revised
        items.append(item)
    return items


def images_response(jobs: list[Job], items: list[JsonObject]) -> JsonObject:
    first = outputs_of(jobs[0], "image")
    size = f"{first[0].width}x{first[0].height}" if first and first[0].width else None
    return {"created": int(jobs[0].created_at), "data": [*items], "output_format": "png", "size": size}


def model_card(spec: PipelineSpec, created: int) -> JsonObject:
    """A pipeline as an OpenAI model (GET /v1/models)."""
    return {"id": spec.name, "object": "model", "created": created, "owned_by": "omni-jobs",
            "description": spec.description.strip(), "output_modalities": [*sorted(output_modalities(spec))],
            "stages": [*(s.id for s in spec.stages)]}


# --- streamed speech (chat with stream=true and the audio modality) ---
STREAM_PIECE_BYTES = PCM_RATE * 2 // 2
"""Audio sent from the final clip (what no delta carried) goes out in pieces of 0.5 s of 24 kHz pcm16."""


def streamed_pcm(chunk: AudioChunk) -> bytes:
    """An audio delta's samples as OpenAI streams audio: 24 kHz pcm16 (resampled when the stage's rate differs)."""
    if chunk.sample_rate == PCM_RATE:
        return chunk.pcm
    samples = np.frombuffer(chunk.pcm, "<i2").astype(np.float32)[np.newaxis, :] / 32767.0
    return pcm16(samples, chunk.sample_rate)


def unsent_pcm(clip_pcm: bytes, handed_out: int, sample_rate: int | None) -> list[bytes]:
    """The part of the final clip (24 kHz pcm16) beyond the ``handed_out`` samples the deltas carried (at their
    ``sample_rate``), in pieces: all of it when no delta came (a stage that does not stream)."""
    offset = 2 * (handed_out * PCM_RATE // sample_rate if sample_rate else 0)
    rest = clip_pcm[offset:]
    return [rest[i:i + STREAM_PIECE_BYTES] for i in range(0, len(rest), STREAM_PIECE_BYTES)]


def audio_delta_message(audio_id: str, *, transcript: str | None = None, data: bytes | None = None,
                        expires_at: int | None = None) -> JsonObject:
    """A chunk's ``delta`` for streamed speech, as OpenAI's clients read it: ``delta.audio`` with the id and one
    of the transcript's new text, base64 pcm16, or (last) ``expires_at``."""
    audio: JsonObject = {"id": audio_id}
    if transcript is not None:
        audio["transcript"] = transcript
    if data is not None:
        audio["data"] = base64.b64encode(data).decode("ascii")
    if expires_at is not None:
        audio["expires_at"] = expires_at
    return {"audio": audio}


def speech_event(kind: Literal["delta", "done"], *, audio: bytes = b"", usage: dict[str, int] | None = None
                 ) -> JsonObject:
    """One SSE event of ``/v1/audio/speech`` with ``stream_format: "sse"``, as OpenAI sends them:
    ``speech.audio.delta`` {audio: base64} or ``speech.audio.done`` {usage}."""
    if kind == "delta":
        return {"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode("ascii")}
    tokens = usage or {}
    return {"type": "speech.audio.done", "usage": {"input_tokens": tokens.get("prompt_tokens", 0),
                                                   "output_tokens": tokens.get("completion_tokens", 0),
                                                   "total_tokens": tokens.get("total_tokens", 0)}}
