"""Dependencies of the routes: the process's Runtime and the Celery producer that enqueues stages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery import Celery
from fastapi import Request

from omni_jobs.dispatch import SendTaskDispatcher
from omni_jobs.queueing import celery_config
from omni_jobs.runtime import Runtime
from omni_jobs.submission import JobSubmitter


class ApiContext:
    """Everything the routes need, made once per API process."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.celery = Celery("omni_jobs_api")
        self.celery.conf.update(celery_config(runtime.settings))
        self.submitter: JobSubmitter = runtime.submitter(SendTaskDispatcher(self._send))

    def _send(self, name: str, args: Sequence[Any], queue: str) -> None:
        self.celery.send_task(name, args=list(args), queue=queue)

    def close(self) -> None:
        self.runtime.redis.close()


def get_context(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx
