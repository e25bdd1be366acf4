"""Dependencies of the routes: the process's Runtime and the Celery producer that enqueues stages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery import Celery
from fastapi import Request

from omni_jobs.dispatch import SendTaskDispatcher, display_name
from omni_jobs.jobs.watch import JobWatcher
from omni_jobs.queueing import celery_config
from omni_jobs.runtime import Runtime
from omni_jobs.submission import JobSubmitter


class ApiContext:
    """Everything the routes need, made once per API process."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.celery = Celery("omni_jobs_api")
        self.celery.conf.update(celery_config(runtime.settings))
        dispatcher = SendTaskDispatcher(self._send)
        self.submitter: JobSubmitter = runtime.submitter(dispatcher)
        runtime.webhook_signer  # noqa: B018 - a malformed OMNI_WEBHOOK_SECRET stops the API here, clearly
        runtime.enable_webhooks(dispatcher)  # e.g. a cancel here sends the `completed` webhook
        self.watcher = JobWatcher.from_url(runtime.settings.redis_url)  # SSE and Prefer: wait

    def _send(self, name: str, args: Sequence[Any], queue: str) -> None:
        # shadow: Flower and the worker logs show omni.run_stage[job_.../ar], so a job id finds its tasks
        self.celery.send_task(name, args=list(args), queue=queue, shadow=display_name(name, args))

    def close(self) -> None:
        self.runtime.redis.close()

    async def aclose(self) -> None:
        await self.watcher.aclose()
        self.close()


def get_context(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx
