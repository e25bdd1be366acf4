"""An engine process's loaded objects, kept out of the cyclic garbage collector's full passes.

A worker that loaded its engines holds millions of objects the collector tracks: torch's modules and
parameters, the diffusers pipeline and its tokenizer, vLLM's structures. Python's full collection
(generation 2) walks every one of them, holding the interpreter: ~0.22 s in the benchmark's DiT worker
and ~0.35 s in its AR worker, once per 400-700 DiT small jobs, and none of those objects was ever
garbage (bench/NOTES.md, "The DiT worker's CPU, per thread and per phase; the collector's full
passes"). Meanwhile the engine's thread cannot return from one torch call to start the next, and every
task thread waits.

``gc.freeze()`` moves the objects alive now to a generation the collector never walks. Taken once the
engines are loaded, a full collection then walks only what was made since: the jobs' objects. A
frozen object that dies later is still freed by reference counting; only a reference cycle among
frozen objects would stay until the process ends, and what is frozen here is the engines, which a
worker keeps for its life.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_loaded_objects() -> int:
    """Collect what loading left behind, then freeze every object alive; returns how many are frozen."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d objects of the loaded engines out of the collector's passes (%.0f ms)",
             frozen, 1000 * (time.perf_counter() - started))
    return frozen
