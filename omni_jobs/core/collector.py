"""How a process's cyclic garbage collector runs: two measured changes to Python's defaults.

**The API's young generation.** Python collects its youngest generation once 700 more container objects
were made than freed. A submit makes ~1,000 (the request, its validation, the job, the change, the
answer), and 16 at once live across their awaits, so the API ran a young collection every ~7 submits,
each walking the live requests' objects and promoting them to older generations, where they died
later: ~6% of the API's CPU went to the collector (gc.callbacks, `python -m bench.submit`'s idle row).
At 20,000 most of a request's objects are freed by their reference counts before a collection sees
them: the API used 0.46 ms of CPU a submit instead of 0.51, and accepted 0.58 of the bare stack's jobs
per second instead of 0.54 (docs/decisions/api-young-generation.md). Garbage cycles wait longer: at most ~20,000 objects, a few MB.

**The engines' objects, frozen.** A worker that loaded its engines holds millions of objects the
collector tracks: torch's modules and parameters, the diffusers pipeline and its tokenizer, vLLM's
structures. Each full collection (generation 2) walked every one of them, holding the interpreter:
~0.22 s in the benchmark's DiT worker, ~0.35 s in its AR worker, once per 400-700 DiT small jobs, and
none of those objects was ever garbage. Meanwhile the engine's thread could not return from one torch
call to start the next, and every task thread waited. ``gc.freeze()`` moves the objects alive now to a
generation the collector never walks; taken once the engines are loaded, a full collection then walks
only what was made since: the jobs' objects (4.7 ms). A frozen object that dies later is still freed
by reference counting; only a reference cycle among frozen objects would stay until the process ends,
and what is frozen is the engines, which a worker keeps for its life.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def set_young_threshold(objects: int) -> None:
    """Collect the youngest generation once ``objects`` more container objects were made than freed; 0
    leaves the threshold as it is (Python's 700). The older generations' thresholds stay as they are."""
    if objects > 0:
        _young, middle, old = gc.get_threshold()
        gc.set_threshold(objects, middle, old)


def freeze_loaded_objects() -> int:
    """Collect what loading left behind, then freeze every object alive; returns how many are frozen."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d objects of the loaded engines out of the collector's passes (%.0f ms)",
             frozen, 1000 * (time.perf_counter() - started))
    return frozen
