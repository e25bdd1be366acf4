"""A typed Python client for the omni-jobs HTTP API, sync (``Client``) and async (``AsyncClient``).

    from omni_jobs.client import Client

    with Client("http://127.0.0.1:8000") as omni:
        job = omni.submit("text-to-image", {"prompt": "a red fox"}, params={"dit": {"seed": 7}}, wait=60)
        for event in omni.events(job.id):          # Server-Sent Events until the job ends
            print(event.type, event.data)
        paths = omni.download_outputs(omni.get(job.id), "out/")

Every endpoint has a method: ``submit`` (with ``wait`` = ``Prefer: wait=N``, webhooks, Idempotency-Key),
``get``, ``list`` / ``iter_jobs``, ``cancel``, ``events`` (and ``stream_text``: an AR stage's text as
it is generated; ``stream_audio``: speech as it is made, ``AudioChunk``s of PCM), ``wait``,
``download`` / ``download_outputs``, ``pipelines``, and ``transcribe``
(speech to text through /v1/audio/transcriptions: a TranscriptionView, or srt/vtt/text). A job is a
``JobView``, the very model the API answers with (omni_jobs.jobs.view). Errors are ``ApiError``
subclasses that carry the server's detail (for a 422: the fields, e.g. ``body.input.prompt``; for a
429: the quota's ``limit``, ``value`` and ``retry_after_s``). It needs only httpx and pydantic.

The two clients share one implementation of everything but I/O (omni_jobs/client/protocol.py: the
requests, the answers, the SSE parser and the loops); the old names of the models (``JobInfo``,
``OutputInfo``, ...) stay as aliases of the views.
"""

from omni_jobs.client.errors import (
    ApiError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    RateLimitedError,
    UnauthorizedError,
    UnavailableError,
)
from omni_jobs.client.http import AsyncClient, Client
from omni_jobs.client.protocol import (
    DEFAULT_API_URL,
    FINAL_EVENTS,
    FINAL_STATUSES,
    FileInput,
    PipelineList,
    SubmitOptions,
    TranscribeOptions,
    TranscriptionSegmentView,
    TranscriptionView,
    output_filename,
)
from omni_jobs.jobs.view import (
    JobErrorView,
    JobEventView,
    JobListView,
    JobView,
    OutputView,
    ProgressView,
    StageView,
    WebhookDeliveryView,
    WebhookView,
)
from omni_jobs.run.audio_stream import AudioChunk

# The names of the client's own models before it parsed the API's views (kept for user code).
JobInfo = JobView
JobPage = JobListView
JobEventInfo = JobEventView
StageInfo = StageView
OutputInfo = OutputView
JobErrorInfo = JobErrorView
WebhookInfo = WebhookView
WebhookDeliveryInfo = WebhookDeliveryView
Progress = ProgressView

__all__ = [
    "DEFAULT_API_URL",
    "FINAL_EVENTS",
    "FINAL_STATUSES",
    "ApiError",
    "AsyncClient",
    "AudioChunk",
    "Client",
    "ConflictError",
    "FileInput",
    "InvalidRequestError",
    "JobErrorInfo",
    "JobErrorView",
    "JobEventInfo",
    "JobEventView",
    "JobInfo",
    "JobListView",
    "JobPage",
    "JobView",
    "NotFoundError",
    "OutputInfo",
    "OutputView",
    "PipelineList",
    "Progress",
    "ProgressView",
    "RateLimitedError",
    "StageInfo",
    "StageView",
    "SubmitOptions",
    "TranscribeOptions",
    "TranscriptionSegmentView",
    "TranscriptionView",
    "UnauthorizedError",
    "UnavailableError",
    "WebhookDeliveryInfo",
    "WebhookDeliveryView",
    "WebhookInfo",
    "WebhookView",
    "output_filename",
]
