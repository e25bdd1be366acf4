"""How a stage task retries after a transient error: through the broker when it can, in the worker
when the broker itself is away (Celery would otherwise drop the task and leave its job running)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery.exceptions import Reject, Retry

from workers import tasks


class BrokerlessTask:
    """Stands in for the bound Celery task: its ``retry`` cannot publish (as when Redis is down)."""

    def __init__(self, *, broker_up: bool) -> None:
        self.request = SimpleNamespace(retries=0)
        self.broker_up = broker_up
        self.sent: list[float] = []

    def retry(self, *, exc: BaseException, countdown: float) -> Any:
        if not self.broker_up:
            raise Reject(exc, requeue=False)  # what Celery's Task.retry raises when the publish fails
        self.sent.append(countdown)
        raise Retry(exc=exc, when=countdown)


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("OMNI_STAGE_MAX_RETRIES", "3")
    monkeypatch.setenv("OMNI_STAGE_RETRY_BACKOFF_S", "0.01")
    tasks.get_settings.cache_clear()
    yield
    tasks.get_settings.cache_clear()  # later tests read their own environment


def failing(times: int) -> Any:
    calls = {"n": 0}

    def attempt() -> str:
        calls["n"] += 1
        if calls["n"] <= times:
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return "succeeded"

    attempt.calls = calls  # type: ignore[attr-defined]
    return attempt


def test_with_the_broker_down_the_worker_retries_the_task_itself() -> None:
    task, attempt = BrokerlessTask(broker_up=False), failing(2)
    assert tasks._retrying_transient_errors(task, "job j stage s", attempt) == "succeeded"  # type: ignore[arg-type]
    assert attempt.calls["n"] == 3 and task.request.retries == 2


def test_with_the_broker_up_a_retry_is_a_new_message() -> None:
    task = BrokerlessTask(broker_up=True)
    with pytest.raises(Retry):
        tasks._retrying_transient_errors(task, "job j stage s", failing(1))  # type: ignore[arg-type]
    assert len(task.sent) == 1 and 0 < task.sent[0] <= 0.015  # backoff 0.01 s with jitter


def test_the_retry_limit_holds_in_the_worker_too() -> None:
    task, attempt = BrokerlessTask(broker_up=False), failing(10)
    with pytest.raises(redis.ConnectionError):
        tasks._retrying_transient_errors(task, "job j stage s", attempt)  # type: ignore[arg-type]
    assert attempt.calls["n"] == 4  # the first try and OMNI_STAGE_MAX_RETRIES=3 retries
