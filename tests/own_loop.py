"""Run a coroutine to the end on an event loop of its own, whatever the calling thread runs.

After the browser tests, Playwright's sync API keeps an event loop running in the main thread, and
``asyncio.run`` refuses to start under it; a fresh thread has no loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def run_in_own_loop(coro: Coroutine[Any, Any, T]) -> T:
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, coro).result()
