"""How engine workers on one CPU host share its cores: one OpenMP team across all, or a worker per slice.

torch (diffusers) and vLLM's CPU backend run every op on an OpenMP team of threads that meet at a
barrier after each op. When another process takes one core for a moment (the API, Redis, a worker's
own Celery threads), the whole team waits for that thread at its next barrier: the system's bookkeeping
costs the engine about its own length again (docs/decisions/another-process-wakeups.md). Worker
processes that each own a slice of the cores do not wait for each other: the same work is only the CPU
it takes. On a 2-core host two single-threaded engines made the benchmark's 64 images 1.14x as fast as
one two-threaded engine, and its 64 texts 1.13x (docs/decisions/engine-worker-per-core.md).

A worker's slice is its ``OMNI_ENGINE_CPUS``: it sets the engines' thread count, vLLM's binding, and
which engines take turns with them (omni_jobs.engines.turns: those on the same CPUs). The price of a
worker per slice is a model copy each (memory) and a single job's latency (it runs on one slice), so it
is a choice (``omni-jobs up --engine-workers N``), not the default.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from omni_jobs.core.cpu_lists import parse_cpus


def cpus_env(spec: str) -> dict[str, str]:
    """What the engine libraries of a worker on these CPUs read before they load: torch's OpenMP thread
    count, and vLLM's binding (vLLM pins its threads; without distinct CPUs every worker's would pile
    onto the same ones). Empty for an empty spec: every CPU, the libraries' own defaults."""
    if not spec.strip():
        return {}
    return {"OMP_NUM_THREADS": str(len(parse_cpus(spec))), "VLLM_CPU_OMP_THREADS_BIND": spec.replace(" ", "")}


def host_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on, by number (a container's cpuset, such as 4-7, not 0..N-1)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return tuple(range(os.cpu_count() or 1))


def cpu_spec(cpus: Sequence[int]) -> str:
    """``cpus`` in the notation ``parse_cpus`` reads: consecutive runs as ranges (``0-3,6``)."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def engine_slice(index: int, workers: int, cpus: Sequence[int]) -> str:
    """The CPUs (``OMNI_ENGINE_CPUS``) of engine worker ``index`` of ``workers`` on a host whose CPUs are
    ``cpus``: an equal share each, in order; workers beyond the CPUs share them round robin, one each."""
    if workers < 1 or not 0 <= index < workers:
        raise ValueError(f"engine worker {index} of {workers}: need 0 <= index < workers and workers >= 1")
    if not cpus:
        raise ValueError("no CPUs to share")
    per = max(1, len(cpus) // workers)
    first = (index * per) % len(cpus)
    return cpu_spec(cpus[first:first + per])
