"""A batch line's result: the output or error line OpenAI's Batch API writes for it, from its ended jobs.

The body of an output line is what the line's route answers for the same jobs (the response shaping of
omni_jobs.accept.openai_responses: chat_completion, image_items, images_response; a job line's body is the job
object of GET /v1/jobs/{id}). A failed, canceled or vanished job gives an error line whose body is the
route's error (openai_responses.finished raises it). Speech, which OpenAI's batches do not carry, is
``{"object": "audio.speech", "model", "response_format", "media_type", "data": <base64>}``; a transcription's
body is the route's in its ``response_format`` (a JSON object, or the text of text, srt and vtt).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass

from omni_jobs.accept.batch_lines import IMAGES, SPEECH, LinePlan, RequestLine
from omni_jobs.accept.openai_audio import read_transcript, transcription_answer
from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.accept.openai_requests import ImageGenerationRequest
from omni_jobs.accept.openai_responses import (
    chat_completion,
    finished,
    first_output,
    image_items,
    images_response,
    needed_outputs,
    text_meta,
)
from omni_jobs.artifacts import ArtifactError, ArtifactRef, codecs
from omni_jobs.core.json_types import JsonObject, JsonValue
from omni_jobs.jobs.models import Job, JobStatus
from omni_jobs.media.audio_formats import convert, media_type

Read = Callable[[ArtifactRef], bytes]


@dataclass(frozen=True)
class Shaping:
    """What an answer needs besides the jobs: their bytes, the job object, download URLs, the outputs' life."""

    read: Read
    present: Callable[[Job], JsonObject]
    url_of: Callable[[Job, str], str]
    output_ttl_s: int


def request_id(batch_id: str, index: int) -> str:
    """The ``id`` of a line's result: stable, so a finalize run again writes the same line."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{index}"


def error_line(batch_id: str, line: RequestLine, code: str, message: str) -> JsonObject:
    """A line that ran no job to its end (refused at submit, cancelled, expired): OpenAI's ``error``."""
    return {"id": request_id(batch_id, line.index), "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _response(batch_id: str, line: RequestLine, status: int, job_ids: list[str], body: JsonValue) -> JsonObject:
    return {"id": request_id(batch_id, line.index), "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": ",".join(job_ids), "body": body}, "error": None}


def _answer(plan: LinePlan, url: str, jobs: list[Job], shaping: Shaping) -> JsonValue:
    """The route's answer body for jobs that all succeeded."""
    openai = plan.openai
    assert openai is not None
    if url == IMAGES:
        fmt = ImageGenerationRequest.model_validate(plan.body).response_format
        items: list[JsonObject] = []
        for job in jobs:
            images = [o for o in job.outputs if o.type == "image"]
            if fmt == "url":
                items += image_items(job, fmt, urls={o.name: shaping.url_of(job, o.name) for o in images})
            else:
                items += image_items(job, fmt, data={o.name: shaping.read(o.artifact) for o in images})
        return images_response(jobs, items)
    (job,) = jobs
    if plan.form is not None:  # a transcription or translation: the speech stage's document, in its format
        stage_id = openai.spec.stages[0].id
        ref = job.stage_record(stage_id).outputs.get("text")
        if ref is None:
            raise ValueError(f"stage '{stage_id}' left no text output")
        temperature = job.params.get(stage_id, {}).get("temperature", 0.0)
        answer, _media_type = transcription_answer(
            read_transcript(codecs.decode_json(shaping.read(ref))), plan.form.response_format,
            temperature=float(temperature) if isinstance(temperature, int | float) else 0.0)
        return answer
    if url == SPEECH:
        audio = convert(shaping.read(first_output(job, "audio").artifact), openai.audio_format)
        return {"object": "audio.speech", "model": openai.spec.name, "response_format": openai.audio_format,
                "media_type": media_type(openai.audio_format), "data": base64.b64encode(audio).decode("ascii")}
    finish, usage = text_meta(openai.spec, job, shaping.read)
    data = {out.name: (convert(shaping.read(out.artifact), openai.audio_format) if out.type == "audio"
                       else shaping.read(out.artifact)) for out in needed_outputs(job, openai.wanted)}
    return chat_completion(openai, job, finish=finish, usage=usage, data=data, output_ttl_s=shaping.output_ttl_s)


def line_result(batch_id: str, line: RequestLine, plan: LinePlan, jobs: list[Job | None], shaping: Shaping
                ) -> tuple[bool, JsonObject]:
    """(ok, the line's result): ok goes to the output file, else to the error file."""
    present = [job for job in jobs if job is not None]
    if len(present) < len(jobs):
        return False, error_line(batch_id, line, "job_gone", "the line's job disappeared (expired?)")
    ids = [job.id for job in present]
    if plan.openai is None:  # /v1/jobs: the job object, whatever its end
        (job,) = present
        if job.status is JobStatus.succeeded:
            return True, _response(batch_id, line, 200, ids, shaping.present(job))
        return False, _response(batch_id, line, 500, ids, {
            "error": {"message": f"job {job.id} {job.status.value}" + (f": {job.error.message}" if job.error else ""),
                      "type": "server_error", "param": None, "code": f"job_{job.status.value}"},
            "job": shaping.present(job)})
    try:
        done = finished(present, list(present), wait_s=0)
        return True, _response(batch_id, line, 200, ids, _answer(plan, line.url, done, shaping))
    except OpenAIError as exc:
        return False, _response(batch_id, line, exc.status, ids, exc.body())
    except (ValueError, KeyError, TypeError, ArtifactError) as exc:  # an output that cannot be read or converted
        error = OpenAIError(500, f"the answer cannot be made from job(s) {', '.join(ids)}: {exc}",
                            type_="server_error", code="invalid_output")
        return False, _response(batch_id, line, 500, ids, error.body())

