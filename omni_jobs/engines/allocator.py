"""The malloc of an engine process: tcmalloc where it is installed, else glibc's with fixed thresholds.

A diffusers pipeline on the CPU allocates and frees its activations at every step. glibc hands large
freed blocks back to the kernel (munmap, or a trim of the heap's top), so the next step faults them
back in, page by page, zeroed. Measured on a DiT batch of 32 (32 px, 20 steps, on a worker's thread;
docs/decisions/engines-malloc.md): glibc as it comes 2.07 s, 282k page faults and 0.53 s of
kernel time; glibc with its thresholds fixed 1.93 s (90k faults, 0.17 s); tcmalloc 1.79 s (1.1k
faults, 0.01 s). In the whole system (bench --ab) the DiT 32px small row gained ~4%, within its
noise. vLLM's AR engine reuses its buffers and is not changed by either (14k faults per 64 requests).

tcmalloc has to be loaded before anything else (LD_PRELOAD), so a process that starts engine
processes sets it in their environment (``engine_process_env``: ``omni-jobs up``, the benchmark's
direct arm). The container image does not preload it: its workers run glibc tuned, or
tcmalloc where the deployment sets LD_PRELOAD (the library installed). The thresholds are set from inside the process
(``tune_engine_malloc``, at a worker's start), and only where tcmalloc is not loaded.

``OMNI_ENGINE_MALLOC`` chooses: ``auto`` (tcmalloc if installed, else glibc tuned), ``tcmalloc``
(required: a launcher refuses to start without it), ``glibc`` (glibc tuned), ``system`` (whatever the
process has, untouched).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import get_args

from omni_jobs.core.settings import MallocChoice

log = logging.getLogger(__name__)

CHOICES: tuple[MallocChoice, ...] = get_args(MallocChoice)
ENV_VAR = "OMNI_ENGINE_MALLOC"

TCMALLOC_LIBRARIES = ("tcmalloc_minimal", "tcmalloc")
"""Debian's libtcmalloc-minimal4 (the allocator alone) first, then gperftools' full library."""

TCMALLOC_ENV_DEFAULTS = {
    # tcmalloc writes a line to stderr for every allocation above 1 GiB by default: a large model's
    # weights are loaded in such blocks, and the line reads like an error.
    "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40),
}

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
GLIBC_TRIM_THRESHOLD = 2**31 - 1
"""(mallopt takes an int: its largest.) Never give the heap's free top back to the kernel: the next step would fault it in again. A worker's
RSS then stays at its peak, which it reaches within its first batches anyway."""
GLIBC_MMAP_THRESHOLD = 32 << 20
"""Blocks up to 32 MiB (glibc's largest allowed) come from the heap, not from a mmap of their own,
which is unmapped when freed. Setting it also stops glibc from moving the thresholds itself."""


class MallocUnavailable(RuntimeError):
    """OMNI_ENGINE_MALLOC=tcmalloc where no tcmalloc library is installed."""


def malloc_choice(env: MutableMapping[str, str] | None = None) -> MallocChoice:
    """The choice in ``env`` (this process's environment when None); a bad value names the good ones."""
    value = (os.environ if env is None else env).get(ENV_VAR) or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(CHOICES)}; got {value!r}")
    return value


def find_tcmalloc() -> str | None:
    """The installed tcmalloc's file name (as LD_PRELOAD takes it), or None."""
    for name in TCMALLOC_LIBRARIES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def engine_process_env(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """``env`` for an engine process about to start: tcmalloc preloaded where chosen and installed."""
    choice = malloc_choice(env)
    if choice not in ("auto", "tcmalloc"):
        return env
    library = find_tcmalloc()
    if library is None:
        if choice == "tcmalloc":
            raise MallocUnavailable(f"{ENV_VAR}=tcmalloc, but no tcmalloc library is installed: install it "
                                    "(Debian/Ubuntu: apt-get install libtcmalloc-minimal4), or set "
                                    f"{ENV_VAR}=auto to fall back to glibc's malloc")
        return env
    preload = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]
    if not any("tcmalloc" in Path(p).name for p in preload):
        env["LD_PRELOAD"] = " ".join([library, *preload])
    for name, value in TCMALLOC_ENV_DEFAULTS.items():
        env.setdefault(name, value)
    return env


def loaded_tcmalloc() -> bool:
    """Whether this process runs on tcmalloc (preloaded, or linked in)."""
    try:
        return "tcmalloc" in Path("/proc/self/maps").read_text()
    except OSError:  # no procfs (not Linux): nothing preloaded it
        return False


def tune_engine_malloc(choice: MallocChoice) -> str:
    """Set glibc's thresholds in this process unless it runs on tcmalloc or ``system`` is chosen;
    returns the allocator in use, for the worker's start-up line."""
    if loaded_tcmalloc():
        return "tcmalloc"
    if choice == "tcmalloc":
        log.warning("%s=tcmalloc, but this process was started without it: preload it "
                    "(LD_PRELOAD=libtcmalloc_minimal.so.4); glibc's malloc is tuned instead", ENV_VAR)
    if choice == "system":
        return "system malloc, untuned"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its own malloc, as it comes
        return "system malloc (no mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD)
    return "glibc, tuned" if ok else "glibc (mallopt refused the thresholds)"
