"""A threads-pool worker's consumer hands each task to its thread before it goes on
(workers/celery_patches.py, pause_after_handoff): a real Celery threads pool, the task's thread and the
caller timed against each other. The first test fails without the patch."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery.concurrency import thread

from workers import celery_patches

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def pool() -> Iterator[thread.TaskPool]:
    original = thread.TaskPool.on_apply
    pool = thread.TaskPool(limit=2)
    pool.start()
    yield pool
    pool.stop()
    thread.TaskPool.on_apply = original  # type: ignore[method-assign]


def apply_and_time(pool: thread.TaskPool) -> tuple[float, float]:
    """(when the task began, when apply_async returned to the consumer)."""
    began: list[float] = []
    done = threading.Event()

    def task() -> None:
        began.append(time.monotonic())
        done.set()

    pool.apply_async(task)
    returned = time.monotonic()
    assert done.wait(5), "the task never ran"
    return began[0], returned


def test_the_task_thread_starts_before_the_consumer_goes_on(pool: thread.TaskPool) -> None:
    apply_and_time(pool)  # the pool's thread exists and waits, as in a running worker
    celery_patches.pause_after_handoff(200.0)  # long enough to hold on a loaded machine; workers pause 0.2 ms
    for _ in range(3):
        began, returned = apply_and_time(pool)
        assert began < returned, "the consumer went on before the task's thread had started"


def test_installing_again_wraps_once_and_zero_removes_the_pause(pool: thread.TaskPool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    installed = thread.TaskPool.on_apply  # wrapped already where a test imported workers.app
    original = getattr(installed, "_omni_original", installed)
    celery_patches.pause_after_handoff(0.2)
    celery_patches.pause_after_handoff(30.0)
    pauses: list[float] = []
    monkeypatch.setattr(celery_patches, "sleep", pauses.append)  # the pauses counted, not timed
    apply_and_time(pool)
    assert pauses == [0.03]  # one pause of the last setting, not two
    celery_patches.pause_after_handoff(0)
    assert thread.TaskPool.on_apply is original


def test_a_worker_process_pauses_as_its_setting_says() -> None:
    show = ("import workers.app; from celery.concurrency import thread; "
            "print(getattr(thread.TaskPool.on_apply, '_omni_original', None) is not None)")
    env = {k: v for k, v in os.environ.items() if k != "OMNI_WORKER_HANDOFF_MS"}

    def paused(extra: dict[str, str]) -> str:
        return subprocess.run([sys.executable, "-c", show], cwd=REPO, env={**env, **extra}, capture_output=True,
                              text=True, check=True).stdout.strip()

    assert paused({}) == "True"
    assert paused({"OMNI_WORKER_HANDOFF_MS": "0"}) == "False"
