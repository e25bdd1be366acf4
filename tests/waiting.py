"""Waiting for something another thread or process does, by its outcome rather than by a fixed sleep.

A test that sleeps a few tens of milliseconds and then asserts that a background thread has done
its work fails whenever the machine is busy. ``wait_until`` polls instead, for a generous time, and
returns as soon as the condition holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float = 10, what: str = "the condition",
               poll_s: float = 0.005) -> T:
    """``predicate()``'s first truthy value; AssertionError naming ``what`` if none came in ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (Linux /proc): a zombie, dead but not yet reaped by its parent, counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
