"""Where an AR engine's core runs, and what a request run again after its core died streams (no vLLM started;
the engine-core process itself: tests/integration/test_ar_engine_core.py, -m chaos)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from omni_jobs.engines import ar_core
from omni_jobs.engines.ar import ARRequest, SamplingOptions, _Reported
from omni_jobs.engines.omni_speech import TALKER_ARCH
from omni_jobs.engines.pool import EnginePool
from tests.waiting import process_alive


@dataclass
class _Completion:
    text: str
    token_ids: list[int]


@dataclass
class _Output:  # the fields of vLLM's RequestOutput that a report reads
    text: str
    token_ids: list[int]
    finished: bool = False
    outputs: list[_Completion] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.outputs = [_Completion(self.text, self.token_ids)]


def _stream() -> tuple[ARRequest, list[str], list[int]]:
    texts: list[str] = []
    counts: list[int] = []
    request = ARRequest("r", "p", SamplingOptions(max_tokens=8), on_text=texts.append)
    return request, texts, counts


def _steps(words: list[str]) -> list[_Output]:
    return [_Output(" ".join(words[:n]), list(range(n)), finished=n == len(words)) for n in range(1, len(words) + 1)]


def test_a_run_again_streams_only_what_passes_what_was_streamed() -> None:
    request, texts, counts = _stream()
    reported = _Reported()
    first = _steps(["a", "b", "c", "d", "e"])
    for out in first[:3]:
        reported.report(request, out, lambda _r, n, _m: counts.append(n))  # type: ignore[arg-type]
    reported.rerun()  # the core died after 3 tokens
    for out in first:
        reported.report(request, out, lambda _r, n, _m: counts.append(n))  # type: ignore[arg-type]
    assert texts == ["a", "a b", "a b c", "a b c d", "a b c d e"]
    assert counts == [1, 2, 3, 4, 5]


def test_a_run_again_that_differs_fails_its_request_and_names_the_fix() -> None:
    request, texts, _ = _stream()
    reported = _Reported()
    for out in _steps(["a", "b", "c"]):
        reported.report(request, out, None)  # type: ignore[arg-type]
    reported.rerun()
    with pytest.raises(RuntimeError, match="seed"):
        reported.report(request, _Output("x", [9]), None)  # type: ignore[arg-type]
    assert texts == ["a", "a b", "a b c"]


def test_a_finished_run_again_reports_even_when_no_longer_than_before() -> None:
    request, texts, _ = _stream()
    reported = _Reported()
    for out in _steps(["a", "b"]):
        reported.report(request, out, None)  # type: ignore[arg-type]
    reported.rerun()
    reported.report(request, _Output("a b", [0, 1], finished=True), None)  # type: ignore[arg-type]
    assert texts == ["a", "a b", "a b"]  # the end is reported so that the stream closes on the whole text


@pytest.mark.parametrize(("choice", "on_gpu", "args", "apart"), [
    ("auto", False, {}, False),
    ("auto", True, {}, True),
    ("on", False, {}, True),
    ("off", True, {}, False),
    ("on", True, {"hf_overrides": {"architectures": [TALKER_ARCH]}}, False),
])
def test_where_an_ar_engines_core_runs(tmp_path: Path, choice: Any, on_gpu: bool, args: dict[str, Any],
                                       apart: bool) -> None:
    pool = EnginePool(tmp_path, kv_cache_bytes=1, max_model_len=16, device="cpu", engine_process=choice)
    pool._on_gpu = on_gpu
    assert pool._ar_apart(args) is apart


def test_a_core_apart_is_spawned_and_not_pinned_to_one_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    with ar_core.core_layout(apart=True):
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
        assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # a threaded worker is never forked
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        assert os.environ[ar_core.PARENT_ENV] == str(os.getpid())  # the core's plugin watches this worker
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    assert ar_core.PARENT_ENV not in os.environ
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")  # a worker's OMNI_ENGINE_CPUS slice is kept
    with ar_core.core_layout(apart=True):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    with ar_core.core_layout(apart=False):
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_a_core_apart_is_built_apart_after_an_in_process_core_cached_vllms_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A core built in the worker (the talker's, the encoder's) caches vLLM's environment for the process; a
    core apart built after it, a restart included, must still read the switch that says apart."""
    envs = pytest.importorskip("vllm.envs")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    envs.enable_envs_cache()  # what an in-process EngineCore does once it is up
    try:
        assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is False
        with ar_core.core_layout(apart=True):
            assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is True
    finally:
        envs.disable_envs_cache()


# A stand-in worker (the parent) that spawns a "core" the way vLLM does, with the plugin's env set; the core
# runs the real plugin entry point and then waits for ever, as a core waits for requests.
_CORE = """
import os, sys, time
from omni_jobs.engines import ar_core
ar_core.exit_with_parent(poll_s=0.05)
print(os.getpid(), flush=True)
time.sleep(600)
"""
_WORKER = """
import os, subprocess, sys, time
env = dict(os.environ)
env[{env}] = str(os.getpid()) if sys.argv[1] == "child" else "1"
core = subprocess.Popen([sys.executable, "-c", sys.argv[2]], env=env, stdout=sys.stdout)
time.sleep(600)
"""


def _spawn_worker(whose: str) -> tuple[subprocess.Popen[str], int]:
    worker = subprocess.Popen([sys.executable, "-c", _WORKER.format(env=repr(ar_core.PARENT_ENV)), whose, _CORE],
                              stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    return worker, int(worker.stdout.readline())


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_core_ends_when_its_worker_is_sigkilled() -> None:
    worker, core = _spawn_worker("child")
    try:
        assert process_alive(core)
        worker.kill()  # SIGKILL: no shutdown of the core from the worker
        worker.wait()
        deadline = time.monotonic() + 10
        while process_alive(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_alive(core), "the core outlived its SIGKILLed worker"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_process_that_is_not_the_named_workers_child_is_not_watched() -> None:
    """vLLM's own workers (children of the core) and the worker itself run the plugin too: they do not watch."""
    worker, core = _spawn_worker("other")  # the env names pid 1, not its parent
    try:
        worker.kill()
        worker.wait()
        time.sleep(0.5)  # ten of the watcher's polls
        assert process_alive(core)
    finally:
        os.kill(core, signal.SIGKILL)
