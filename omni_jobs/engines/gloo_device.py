"""vLLM's process groups on one gloo device per process, so that an idle engine wakes ~100 times a second, not ~1,300.

Even a one-process, one-rank vLLM engine makes about thirteen gloo process groups (the world group, then
a device group and a CPU group for each kind of parallelism). torch gives each group a gloo TCP device
of its own, and each device runs a loop thread that wakes every 10 ms (gloo's ``epoll_wait`` timeout)
whether or not anything is sent: 13 threads, ~1,300 wake-ups a second, ~1.5% of a core, in every AR
worker, busy or idle. On CPU cores those wake-ups preempt the OpenMP threads of the engines beside them,
which then wait at their next barrier: a DiT batch ran 2.9% slower beside two idle AR engines than with
them stopped (docs/decisions/one-gloo-device.md). A gloo device is meant to carry many contexts, so
the groups made while ``one_gloo_device`` is active share one device, hence one loop thread.

Only the constructor that torch's ``new_group`` and ``init_process_group`` call is changed, and only
inside the block. Where this torch has no ``ProcessGroupGloo._Options``, or ``GLOO_SOCKET_IFNAME`` picks
interfaces (a multi-node setup: torch then makes a device per interface), nothing is changed.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

_lock = threading.RLock()
_device: Any = None
"""This process's shared gloo device, made on first use."""


def _shared_device(process_group_gloo: Any) -> Any:
    global _device
    if _device is None:
        _device = process_group_gloo.create_default_device()
    return _device


@contextmanager
def one_gloo_device() -> Iterator[None]:
    """Within the block, every gloo process group made in this process uses this process's one device."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        yield
        return
    try:
        c10d: Any = importlib.import_module("torch.distributed.distributed_c10d")  # torch's module, patched below
        original: Any = c10d.ProcessGroupGloo
        options_class = original._Options
    except (ImportError, AttributeError):  # a torch without gloo, or another constructor API
        yield
        return
    with _lock:
        try:
            device = _shared_device(original)
        except RuntimeError:  # no default device here (torch's groups would then fail as they do without this)
            yield
            return

        class OneDeviceProcessGroupGloo(original):  # type: ignore[misc]  # torch's ProcessGroupGloo is typed Any here
            """``ProcessGroupGloo(store, rank, size, timeout=...)`` (torch's own call) on the shared device."""

            def __init__(self, store: Any, rank: int, size: int, timeout: timedelta = timedelta(minutes=30)) -> None:
                options = options_class()
                options._devices = [device]
                options._timeout = timeout
                super().__init__(store, rank, size, options)

        c10d.ProcessGroupGloo = OneDeviceProcessGroupGloo
        try:
            yield
        finally:
            c10d.ProcessGroupGloo = original


def destroy_process_groups() -> None:
    """Destroy this process's torch process groups, if it made any, while the interpreter is whole:
    a worker calls it as it shuts down. Left to the interpreter's teardown, a gloo group's C++ threads
    were sometimes destroyed unjoined, and the process aborted after its work was done (``terminate
    called without an active exception``, exit code 134): 3 of 100 processes with torch's own groups
    and 9 of 160 with the shared device, 4 at once on 2 cores; 0 of 200 with this."""
    dist: Any = sys.modules.get("torch.distributed")  # a process that never loaded torch has no groups
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
