"""What a process that runs engines sets for torch's native libraries, before torch loads.

Worker processes apply these (workers/app.py), and so does the benchmark's direct arm, so that the
system and the engine called directly run the same libraries the same way. A value already in the
environment wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from omni_jobs.engines.cpu_layout import cpus_env

ENGINE_LIBRARY_DEFAULTS: dict[str, str] = {
    # oneDNN (torch's CPU matmuls) keeps a compiled primitive per matmul shape, 1,024 of them by default,
    # and a CPU AR worker meets a new shape with almost every batch: it held 200-360 MB more after 2,000
    # to 6,000 jobs (python -m bench.soak: 1.16-1.26 of its RSS after job 200). 128 keeps it flat (1.03)
    # at the same speed (bench --ab).
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128",
    # torch's OpenMP threads (libgomp) spin before they sleep at a barrier: 300,000 times (~3 ms) while the
    # process's teams fit on the CPUs, which they do (engines load on a passing thread, see
    # omni_jobs.engines.pool). Alone, an engine needs ~20,000 (the same vLLM batches: 6.7 s at 20,000, 6.5
    # at 300,000, 7.1 s at 5,000, 7.5 s never spinning). More only burns CPU that an AR and a DiT worker on
    # the same cores take from each other (docs/decisions/one-openmp-team.md).
    "GOMP_SPINCOUNT": "20000",
}


def apply_engine_library_defaults(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set each default in ``env`` (this process's environment when None) unless it has a value; returns it.
    A worker given its CPUs (``OMNI_ENGINE_CPUS``) also gets the thread count and binding they imply."""
    target: MutableMapping[str, str] = os.environ if env is None else env
    for name, value in {**ENGINE_LIBRARY_DEFAULTS, **cpus_env(target.get("OMNI_ENGINE_CPUS", ""))}.items():
        target.setdefault(name, value)
    return target
