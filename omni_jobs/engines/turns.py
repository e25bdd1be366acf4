"""Engines that share a host's CPU cores take turns, one engine step at a time.

A CPU engine (vLLM's CPU build, a diffusers pipeline on the CPU) runs every op on a torch OpenMP
team as wide as the machine. Two engines computing at once in two worker processes on the same
cores (the AR and the DiT worker of ``omni-jobs up`` in a multi-stage pipeline) oversubscribe
them: at every barrier of every op a team waits for a thread that the other team preempted.
Taking turns, each step runs with every core, as it would alone, and the two engines' steps
interleave instead of slowing each other down. Measured on 2 cores (``python -m bench --only
multi-stage --ab OMNI_ENGINE_TURNS=off``, 3 paired reps): 1.075x the jobs/s of without (1.053,
1.12, 1.075), the DiT worker using 19.5 s of CPU per repetition instead of 25.4.

The turn is an exclusive ``flock`` on a file of the host (the kernel drops it when its holder
dies, SIGKILL included), entered through a second one, the gate, that a waiter holds while it
waits: a holder that passes its turn queues behind that waiter, so two busy engines alternate
instead of the one that just stepped taking the turn straight back. Threads of one process take
it one at a time. Off unless configured: a Runtime's engines configure it from
``OMNI_ENGINE_TURNS`` (auto: when the engines run on the CPU). An engine alone on its host pays
four system calls per step.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


class EngineTurns:
    """The host's engine turn, as this process takes it (one per process: ``configure``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # read-only is enough to flock, so workers running as other users share the files
        self._turn = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        self._gate = os.open(path.with_name(path.name + ".gate"), os.O_RDONLY | os.O_CREAT, 0o644)
        self._threads = threading.Lock()
        self._holder = threading.local()

    def held(self) -> bool:
        return bool(getattr(self._holder, "depth", 0))

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the turn for the block (reentrant within a thread)."""
        if self.held():
            self._holder.depth += 1
            try:
                yield
            finally:
                self._holder.depth -= 1
            return
        self._take()
        self._holder.depth = 1
        try:
            yield
        finally:
            self._holder.depth = 0
            self._give()

    def pass_turn(self) -> None:
        """Between two steps: let a waiting engine take its step, then take the turn back."""
        if not self.held():
            return
        self._give()
        self._take()

    def _take(self) -> None:
        self._threads.acquire()
        try:
            fcntl.flock(self._gate, fcntl.LOCK_EX)
            try:
                fcntl.flock(self._turn, fcntl.LOCK_EX)
            finally:
                fcntl.flock(self._gate, fcntl.LOCK_UN)
        except BaseException:
            self._threads.release()
            raise

    def _give(self) -> None:
        try:
            fcntl.flock(self._turn, fcntl.LOCK_UN)
        finally:
            self._threads.release()

    def close(self) -> None:
        os.close(self._turn)
        os.close(self._gate)


DEFAULT_FILE = Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()) / "omni-jobs-engine-turns"
"""Where the engines of one host meet (a container sees its own /dev/shm: mount one file to share it)."""

_turns: EngineTurns | None = None


def lock_file(setting: str, device: str, cpus: str = "") -> Path | None:
    """The lock file that ``OMNI_ENGINE_TURNS`` names: 'off' none; 'auto' the host's default file
    when the engines run on the CPU (``device``: OMNI_DEVICE), none on a GPU; else that path.
    Engines given CPUs of their own (``cpus``: OMNI_ENGINE_CPUS) take turns only with the engines on
    the same CPUs: each list of CPUs has its own file."""
    if setting == "off" or (setting == "auto" and not _engines_on_cpu(device)):
        return None
    path = DEFAULT_FILE if setting == "auto" else Path(setting)
    spec = cpus.replace(" ", "")
    return path.with_name(f"{path.name}.cpus-{spec}") if spec else path


def _engines_on_cpu(device: str) -> bool:
    """Whether engines on ``device`` (OMNI_DEVICE) compute on the CPU: 'auto' does where torch sees no GPU."""
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device == "cpu"


def configure(path: Path | None) -> None:
    """Take turns through the lock file ``path`` from now on (None: not at all). Called once per
    process before its engines run (omni_jobs.runtime)."""
    global _turns
    if _turns is not None and _turns.path == path:
        return
    old, _turns = _turns, None
    if path is not None:
        try:
            _turns = EngineTurns(path)
        except OSError as exc:  # a worker that cannot share the turn still works, as before turns
            log.warning("engines will not take turns: cannot open %s (%s); set OMNI_ENGINE_TURNS to a "
                        "writable path or to off", path, exc)
    if old is not None:
        old.close()


@contextmanager
def engine_turn() -> Iterator[None]:
    """One engine step (or call) of this process, in its turn when turns are configured."""
    turns = _turns
    if turns is None:
        yield
        return
    with turns.turn():
        yield


def pass_turn() -> None:
    """Called between the steps of a long engine call that holds the turn."""
    turns = _turns
    if turns is not None:
        turns.pass_turn()


def taking_turns() -> bool:
    return _turns is not None
