"""A typed Python client for the omni-jobs HTTP API, sync (``Client``) and async (``AsyncClient``).

    from omni_jobs.client import Client

    with Client("http://127.0.0.1:8000") as omni:
        job = omni.submit("text-to-image", {"prompt": "a red fox"}, params={"dit": {"seed": 7}}, wait=60)
        for event in omni.events(job.id):          # Server-Sent Events until the job ends
            print(event.type, event.data)
        paths = omni.download_outputs(omni.get(job.id), "out/")

Every endpoint has a method: ``submit`` (with ``wait`` = ``Prefer: wait=N``, webhooks, Idempotency-Key),
``get``, ``list`` / ``iter_jobs``, ``cancel``, ``events`` (and ``stream_text``: an AR stage's text as
it is generated), ``wait``, ``download`` /
``download_outputs``, ``pipelines``. Errors are ``ApiError`` subclasses that carry the server's
detail (for a 422: the fields, e.g. ``body.input.prompt``). It needs only httpx and pydantic.
"""

from omni_jobs.client.http import (
    DEFAULT_API_URL,
    FINAL_EVENTS,
    FINAL_STATUSES,
    ApiError,
    AsyncClient,
    Client,
    ConflictError,
    FileInput,
    InvalidRequestError,
    JobErrorInfo,
    JobEventInfo,
    JobInfo,
    JobPage,
    NotFoundError,
    OutputInfo,
    PipelineList,
    Progress,
    StageInfo,
    UnavailableError,
    WebhookDeliveryInfo,
    WebhookInfo,
    output_filename,
)

__all__ = [
    "DEFAULT_API_URL",
    "FINAL_EVENTS",
    "FINAL_STATUSES",
    "ApiError",
    "AsyncClient",
    "Client",
    "ConflictError",
    "FileInput",
    "InvalidRequestError",
    "JobErrorInfo",
    "JobEventInfo",
    "JobInfo",
    "JobPage",
    "NotFoundError",
    "OutputInfo",
    "PipelineList",
    "Progress",
    "StageInfo",
    "UnavailableError",
    "WebhookDeliveryInfo",
    "WebhookInfo",
    "output_filename",
]
