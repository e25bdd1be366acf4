"""Where an AR engine's step loop runs: in the worker's process, or in vLLM's own engine-core process.

vLLM v1 can run its engine core (scheduler, model, KV cache) in a process of its own, fed over ZeroMQ by the
``LLM`` object that stays in the worker (``VLLM_ENABLE_V1_MULTIPROCESSING``): the worker's threads (leases,
commits, artifact writes, Celery) then never hold the interpreter lock that the engine's step loop needs.
That is the layout on a GPU (``OMNI_ENGINE_PROCESS=auto``); on shared CPU cores the core process and the
worker's output processing compete, so it stays off there (docs/decisions/vllm-engine-core-in-process.md).

vLLM reads the switch from the environment when an ``LLM`` is built, so builds take a lock and set it each
time; the core process is spawned, never forked, because a stage worker is a threaded process.

A core ends with the worker that started it, however the worker ends: vLLM's core does not notice its
client's death (its own workers do, through a pipe), so this project's vLLM plugin (``exit_with_parent``,
run in every vLLM process) watches the parent of a core that one of our workers spawned.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM

log = logging.getLogger(__name__)

PARENT_ENV = "OMNI_ENGINE_PARENT_PID"
"""Set while a core is built apart: the pid of the worker, whose child the core will be."""

_BUILD = threading.Lock()
"""Held while an ``LLM`` is built: the environment it reads is the process's."""


@contextlib.contextmanager
def core_layout(apart: bool) -> Iterator[None]:
    """The environment under which vLLM builds an ``LLM`` whose core runs apart (True) or in this process.

    Apart, the core process is spawned (a fork of a threaded worker can inherit a held lock) and keeps
    ``VLLM_CPU_OMP_THREADS_BIND`` as the worker's CPU layout set it; without one vLLM would pin its threads
    to one core and reserve the rest, so it is told not to bind."""
    saved = {k: os.environ.get(k) for k in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_CPU_OMP_THREADS_BIND", PARENT_ENV)}
    with _BUILD:
        _read_environment_afresh()
        # left as this build had it afterwards: vLLM reads it again later (its engine's own checks)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if apart else "0"
        if apart:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ[PARENT_ENV] = str(os.getpid())
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _read_environment_afresh() -> None:
    """Make vLLM read its environment again at the next build.

    An engine core caches vLLM's environment variables once it is up (``vllm.envs.enable_envs_cache``); one
    built in this process (the talker, the pooling encoder) caches them for the whole process, and a core
    started apart after that, a restart included, would be built in-process from the cached switch."""
    try:
        from vllm import envs
    except ImportError:  # no vLLM: nothing is cached
        return
    envs.disable_envs_cache()


def _core_process(llm: LLM) -> Any:
    """``llm``'s engine-core process (a multiprocessing Process), or None when its core runs in this process."""
    client: Any = llm.llm_engine.engine_core
    resources = getattr(client, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    processes = getattr(manager, "processes", None) or []
    return processes[0] if processes else None


def core_pid(llm: LLM) -> int | None:
    """The pid of ``llm``'s engine-core process; None when its core runs in this process."""
    process = _core_process(llm)
    return int(process.pid) if process is not None else None


def watch_core(llm: LLM) -> None:
    """Wake a caller waiting on ``llm``'s outputs when its engine-core process dies.

    vLLM's sync client (``SyncMPClient``, 0.32) notices the death and shuts its output thread down, but puts
    nothing on the queue that ``LLMEngine.step`` waits on, so a step under way would wait for ever; its async
    client puts ``EngineDeadError`` there. This thread does what the async client does."""
    process = _core_process(llm)
    if process is None:
        return
    client: Any = llm.llm_engine.engine_core

    def wait_for_death() -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        multiprocessing.connection.wait([process.sentinel])
        client.outputs_queue.put_nowait(EngineDeadError())

    threading.Thread(target=wait_for_death, name=f"omni-core-watch-{process.pid}", daemon=True).start()


def is_core_death(exc: BaseException) -> bool:
    """Whether ``exc`` says the engine-core process is gone (it is restarted), not that a request failed."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)


def shut_down(llm: LLM) -> None:
    """Stop ``llm``'s engine-core process (a dead one's resources too); a no-op for an in-process core."""
    client: Any = llm.llm_engine.engine_core
    with contextlib.suppress(Exception):  # a dead core's sockets may already be closed
        client.shutdown()


def exit_with_parent(poll_s: float = 1.0) -> None:
    """vLLM plugin: in an engine-core process that one of our workers spawned, end it when that worker is gone.

    Every vLLM process runs its general plugins; only the worker's direct child (its parent the pid in
    ``OMNI_ENGINE_PARENT_PID``) watches. A SIGKILLed worker leaves its core to init otherwise, holding its
    model's memory for good; the core's own workers follow it through vLLM's death pipe."""
    try:
        parent = int(os.environ.get(PARENT_ENV, "0"))
    except ValueError:
        return
    if parent <= 0 or parent == os.getpid() or os.getppid() != parent:
        return
    threading.Thread(target=_exit_when_orphaned, args=(parent, poll_s), name="omni-parent-watch", daemon=True).start()


def _exit_when_orphaned(parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    log.warning("engine core %d: its worker (pid %d) is gone; exiting", os.getpid(), parent)
    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()
    os._exit(1)
