"""Handing a thread's OpenMP team back while the thread waits for work.

PyTorch's CPU kernels run on an OpenMP team that belongs to the calling thread, and a thread keeps
its team (helper threads, asleep) for as long as it lives. libgomp lets a team spin at its barriers
only while the threads of all the process's teams fit on the CPUs; past that, every barrier of every
op sleeps in the kernel. A worker keeps a batcher thread per engine it has served (every pipeline on
its queues), so an idle engine's team slowed the busy one: a torch loop on one thread took 0.27 s
beside two idle threads that had each run one op, 0.11-0.12 s alone, and 0.11 s once those two had
released their teams; a DiT batch 3.65 s against 3.34 (docs/decisions/idle-openmp-teams.md). OpenMP 5's ``omp_pause_resource_all`` ends the calling thread's helper threads; its next
parallel op makes a new team (thread starts: tens of microseconds).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1
"""``omp_pause_soft``: end the helper threads; the runtime starts again on the next parallel region."""

_RUNTIME_NAMES = ("libgomp", "libomp", "libiomp5")
_MAPS = Path("/proc/self/maps")
_lock = threading.Lock()
_handles: dict[str, ctypes.CDLL | None] = {}  # path -> its handle (None: it has no omp_pause_resource_all)


def _mapped_runtime_paths() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process now (none where /proc cannot say)."""
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return []
    paths = {fields[-1] for fields in map(str.split, lines) if len(fields) >= 6 and fields[-1].startswith("/")}
    return sorted(p for p in paths if Path(p).name.startswith(_RUNTIME_NAMES))


def loaded_openmp_runtimes() -> list[ctypes.CDLL]:
    """The OpenMP runtimes this process has loaded (torch's bundled libgomp; a tokenizer may bring its
    own); empty before torch loads. Read again at each call (once per idle spell of a batcher): a
    library loaded later is found too."""
    found: list[ctypes.CDLL] = []
    with _lock:
        for path in _mapped_runtime_paths():
            if path not in _handles:
                try:
                    lib = ctypes.CDLL(path)  # already mapped: this only takes a handle on it
                    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                    lib.omp_pause_resource_all.restype = ctypes.c_int
                    _handles[path] = lib
                except (OSError, AttributeError):  # an OpenMP runtime older than 5.0: nothing to call
                    log.debug("%s cannot release its threads", path)
                    _handles[path] = None
            handle = _handles[path]
            if handle is not None:
                found.append(handle)
    return found


def release_thread_team() -> int:
    """End the calling thread's OpenMP helper threads (it must be outside any parallel region, as a
    batcher's thread between batches is); returns how many runtimes released."""
    released = 0
    for lib in loaded_openmp_runtimes():
        if lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0:
            released += 1
    return released
