"""SIGKILL vLLM's engine-core processes under running AR stages: the worker starts a fresh core and runs the
stages' requests again, within the same stage attempts; SIGKILL the worker and its cores go with it (heavy: a
worker whose vLLM cores run apart, one per AR engine it loads, started twice; ``-m chaos``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import submit, wait_for_job
from tests.fault.conftest import FaultSystem
from tests.fault.test_faults import duplicates, events_of, report, wait_until
from tests.waiting import process_alive

pytestmark = pytest.mark.chaos
PARAMS = {"ar": {"max_tokens": 200, "temperature": 1.0, "seed": 5}}  # seeded: a run again repeats the text


def _children(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(proc.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _cores(worker_pid: int) -> list[int]:
    """The vLLM engine-core processes its worker started (vLLM titles them ``VLLM::EngineCore``)."""
    found = []
    for pid in _children(worker_pid):
        try:
            if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def apart_worker(faults: FaultSystem) -> Iterator[int]:
    """The system's ar worker swapped for one whose vLLM core runs apart (OMNI_ENGINE_PROCESS=on); the usual one
    is back afterwards. (A queue of its own in the session's pipelines would keep /readyz unready for every other test.)"""
    usual = faults.process("worker-ar")
    usual.stop()
    faults.system.processes.remove(usual)  # stopped on purpose: not a process that died
    worker = faults.system.start_worker("ar", name="ar-apart", env={"OMNI_ENGINE_PROCESS": "on"}, pool="threads")
    try:
        assert worker.pid is not None
        wait_until(lambda: _cores(worker.pid or 0), timeout_s=240, what="the worker's vLLM engine core")
        faults.system.wait_for_workers({"ar"})
        yield worker.pid
    finally:
        worker.stop()
        faults.system.processes.remove(worker)
        usual.start()
        faults.system.processes.append(usual)
        faults.system.wait_for_workers({"ar"})


def _tokens(api: httpx.Client, job_id: str) -> int:
    job = api.get(f"/v1/jobs/{job_id}").json()
    return int(job["progress"]["step"]) if job["stage"] == "ar" and job["progress"] else 0


def test_sigkill_the_vllm_engine_core_mid_stage_and_its_worker_runs_the_requests_again(
        faults: FaultSystem, api: httpx.Client, apart_worker: int) -> None:
    before = set(_cores(apart_worker))  # one core per AR engine the worker loaded (its queue serves several)
    assert before
    jobs = [submit(api, "text-to-text", "core kill", PARAMS) for i in range(3)]
    victim = wait_until(lambda: next((j["id"] for j in jobs if _tokens(api, j["id"]) >= 5), None),
                        timeout_s=120, what="an AR stage 5 tokens in")
    for core in before:  # the cores alone: their worker, leases and messages live on
        os.kill(core, signal.SIGKILL)
    killed_at = time.time()
    done = [wait_for_job(api, j["id"], timeout_s=300) for j in jobs]
    assert [d["status"] for d in done] == ["succeeded"] * 3, [d["error"] for d in done]
    assert [d["stages"][0]["attempts"] for d in done] == [1] * 3  # run again inside the same attempts
    try:
        after = wait_until(lambda: set(_cores(apart_worker)) - before, timeout_s=120, what="the fresh engine core")
    except AssertionError:
        seen = {pid: _cmdline(pid) for pid in _children(apart_worker)}
        raise AssertionError(f"no engine core under worker {apart_worker}; its children: {seen}") from None
    assert after and not after & before
    assert not [e for e in events_of(api, victim) if e["type"] == "stage.requeued"]
    texts = {next(o["text"] for o in d["outputs"] if o["type"] == "text") for d in done}
    clean = wait_for_job(api, submit(api, "text-to-text", "core kill", PARAMS)["id"])
    assert texts == {next(o["text"] for o in clean["outputs"] if o["type"] == "text")}  # seeded: the same text
    duplicated = duplicates(faults, done, outputs_per_job=1)
    assert duplicated == 0
    report("SIGKILL the vLLM engine core mid-stage", done, duplicated, max(d["completed_at"] for d in done) - killed_at)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()[:120]
    except OSError:
        return b"(gone)"


def test_sigkill_the_worker_and_its_vllm_engine_core_goes_with_it(apart_worker: int) -> None:
    """A worker that dies unannounced leaves no core behind (it would hold its model's memory for good)."""
    cores = _cores(apart_worker)
    assert cores
    os.kill(apart_worker, signal.SIGKILL)
    wait_until(lambda: not any(process_alive(core) for core in cores), timeout_s=30,
               what="the cores of a SIGKILLed worker to exit")
