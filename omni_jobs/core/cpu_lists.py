"""Linux's cpuset notation (``0``, ``2-3``, ``0,2,4-5``), read once for the settings and the engines.

OMNI_ENGINE_CPUS is written in it, and vLLM's VLLM_CPU_OMP_THREADS_BIND takes the same notation.
"""

from __future__ import annotations

import re

_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def parse_cpus(spec: str) -> tuple[int, ...]:
    """The CPUs of a list such as ``2``, ``0-3`` or ``0,2,4-5`` (Linux's cpuset notation, as vLLM's
    VLLM_CPU_OMP_THREADS_BIND takes it), in order, each once."""
    text = spec.replace(" ", "")
    if not _CPU_LIST.match(text):
        raise ValueError(f"OMNI_ENGINE_CPUS={spec!r}: expected CPUs such as '0', '2-3' or '0,2,4-5'")
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ValueError(f"OMNI_ENGINE_CPUS={spec!r}: the range {part} runs backwards; write {hi}-{lo}")
        cpus += [c for c in range(lo, hi + 1) if c not in cpus]
    return tuple(cpus)
