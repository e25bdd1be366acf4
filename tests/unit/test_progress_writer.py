"""Stage progress written off the engine's thread: coalesced, never after the stage ended, and the
place where a cancel is noticed. In-memory job store, no services."""

from __future__ import annotations

import threading
from typing import Any

from omni_jobs.cancellation import cancel_job
from omni_jobs.jobs import state
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.models import Job, JobEvent, now
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.progress_writer import ProgressWriter
from omni_jobs.submission import build_job, resolve_params

T2I = load_catalogue().get("text-to-image")


def running_job(store: MemoryJobStore, stage: str = "ar") -> Job:
    job = build_job(T2I, {"prompt": "a cat"}, resolve_params(T2I, {}))
    store.create(job, [])
    store.update(job.id, lambda j: state.stage_queued(j, stage, now()) + state.stage_started(j, stage, "w", now()))
    return store.require(job.id)


def progress_steps(store: MemoryJobStore, job_id: str) -> list[int]:
    return [e.data["step"] for e in store.events(job_id) if e.type == "stage.progress"]


class SlowStore(MemoryJobStore):
    """Holds every write until released, as a slow Redis would: reports pile up meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def update(self, job_id: str, mutate: Any) -> tuple[Job, list[JobEvent]]:
        self.gate.wait(10)
        return super().update(job_id, mutate)


def test_report_returns_before_the_write_and_only_the_newest_report_is_written() -> None:
    store = SlowStore()
    job = running_job(store)
    writer = ProgressWriter(store)
    store.gate.clear()  # the store stalls: report() must not
    writer.report(job.id, "ar", 1, 32, "tokens")
    for step in range(2, 11):
        writer.report(job.id, "ar", step, 32, "tokens")
    assert progress_steps(store, job.id) == []
    store.gate.set()
    assert writer.flush()
    steps = progress_steps(store, job.id)
    assert steps[-1] == 10 and len(steps) <= 2, steps  # the first (already taken) and the newest
    progress = store.require(job.id).progress
    assert progress is not None and (progress.step, progress.total, progress.unit) == (10, 32, "tokens")


def test_a_write_finds_the_cancel_and_the_stage_sees_it() -> None:
    store = MemoryJobStore()
    job = running_job(store)
    writer = ProgressWriter(store)
    cancel_job(store, job.id)
    assert not writer.canceled(job.id)
    writer.report(job.id, "ar", 3, 32, "tokens")
    assert writer.flush()
    assert writer.canceled(job.id)
    assert progress_steps(store, job.id) == []  # nothing written to a canceled job
    writer.finish(job.id, "ar")
    assert not writer.canceled(job.id)


def test_a_late_report_never_lands_after_the_stage_ended() -> None:
    store = SlowStore()
    job = running_job(store)
    writer = ProgressWriter(store)
    store.gate.clear()
    writer.report(job.id, "ar", 31, 32, "tokens")  # taken by the writer, stuck in the store
    store.gate.set()
    store.update(job.id, lambda j: state.stage_succeeded(j, "ar", {}, {}, now()))
    writer.report(job.id, "ar", 32, 32, "tokens")
    writer.finish(job.id, "ar")
    assert writer.flush()
    after = store.require(job.id)
    assert after.progress is None and after.stage is None
    assert progress_steps(store, job.id) in ([], [31])


def test_inline_mode_writes_before_report_returns() -> None:
    store = MemoryJobStore()
    job = running_job(store)
    writer = ProgressWriter(store, background=False)
    writer.report(job.id, "ar", 5, 8, "steps")
    assert progress_steps(store, job.id) == [5]
    cancel_job(store, job.id)
    writer.report(job.id, "ar", 6, 8, "steps")
    assert writer.canceled(job.id) and progress_steps(store, job.id) == [5]
