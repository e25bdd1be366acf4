"""A hard time limit for code that cannot be interrupted (a C-level engine call).

Soft limits are cooperative (the stage checks at each step); when a call never returns, the only
way to free the worker is to end its process. The watchdog first records why (so the redelivered
message finds the job final and is dropped), then exits; the supervisor starts a fresh worker.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

EXIT_CODE = 75
"""Process exit status after a hard time limit (EX_TEMPFAIL)."""


@contextmanager
def hard_time_limit(seconds: float, on_expire: Callable[[], None], *, exit_process: bool = True) -> Iterator[None]:
    """Run the body; if it is still running after ``seconds``, call ``on_expire`` then exit the process."""

    def fire() -> None:
        try:
            on_expire()
        except Exception:  # the exit must happen even if recording the failure did not
            log.exception("could not record the hard time limit")
        if exit_process:
            log.critical("hard time limit of %gs reached: exiting this worker process", seconds)
            logging.shutdown()
            os._exit(EXIT_CODE)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
