"""Concurrent writers' syncs, shared: one ``syncfs`` makes every file written before it durable.

A DiT batch ends with its outputs written at once, each by its own thread, and each ``fsync`` of its
own file flushed the disk on its own. On this project's 2-core VM those flushes cost the DiT 32px
small row ~5% (the same system without them: 0.939 and 0.950 of its jobs/s, paired). Here the
first writer to ask syncs the filesystem, after waiting up to ``gather_s`` for the writers still on
their way; those who ask meanwhile wait for the next sync, which one of them then begins for all of
them, as a group commit does with a database's log (paired against an fsync each: 1.041, 9 reps;
docs/decisions/one-syncfs-per-batch.md).

The guarantee is the one a writer's own ``fsync`` gave, and a little more: a sync that began after a
file was written and renamed into place covers its data and its name. A failed sync fails every
writer it was to cover. ``syncfs`` also writes back what other programs left unwritten on that
filesystem, so a writer may wait for a neighbour's large write. Where the C library has no
``syncfs`` (not Linux), each writer fsyncs its own file, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

SyncFs = Callable[[int], None]
"""Make the whole filesystem holding this open file durable (raises OSError)."""

def libc_syncfs() -> SyncFs | None:
    """Linux's ``syncfs(2)`` through the C library, or None where there is none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        function = libc.syncfs
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int

    def syncfs(fd: int) -> None:
        if function(fd) != 0:
            code = ctypes.get_errno() or errno.EIO
            raise OSError(code, f"syncfs: {os.strerror(code)}")

    return syncfs


@dataclass
class _Filesystem:
    started: int = 0
    """Syncs begun so far; the next one gets ``started + 1``."""
    done: int = 0
    running: bool = False
    waiting: dict[int, int] = field(default_factory=dict)
    """Writers waiting, by the sync that covers them."""
    failed: dict[int, OSError] = field(default_factory=dict)
    """Failed syncs' errors, kept while a writer they covered has not read it."""


class GroupSync:
    """One process's shared syncs, one line of them per filesystem (``st_dev``)."""

    def __init__(self, syncfs: SyncFs | None, *, gather_s: float = 0.002) -> None:
        self._syncfs = syncfs
        self.gather_s = gather_s
        self._cond = threading.Condition()
        self._filesystems: dict[int, _Filesystem] = {}
        self._writing = 0
        self.syncs = 0
        """Syncs made (the tests read it)."""

    @property
    def shared(self) -> bool:
        """Whether writers share syncs (False: each fsyncs its own file)."""
        return self._syncfs is not None

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Around a write that ends in ``sync``: a sync about to begin waits a moment for it to get there."""
        with self._cond:
            self._writing += 1
        try:
            yield
        finally:
            with self._cond:
                self._writing -= 1
                self._cond.notify_all()

    def sync(self, fd: int) -> None:
        """Return once what was written through ``fd``, and the file's name, are on stable storage.
        Called within ``writing``."""
        if self._syncfs is None:
            os.fsync(fd)
            return
        device = os.fstat(fd).st_dev
        with self._cond:
            self._writing -= 1  # arrived (``writing`` counts it back on the way out)
            self._cond.notify_all()
            fs = self._filesystems.setdefault(device, _Filesystem())
            # The next sync to begin covers this file (one gathering writers has not begun yet); one
            # already running may have begun before the file was written.
            ticket = fs.started + 1
            fs.waiting[ticket] = fs.waiting.get(ticket, 0) + 1
            try:
                while fs.done < ticket:
                    if fs.running:
                        self._cond.wait()
                    else:
                        self._run(fs, fd)  # its number is ``ticket``: syncs of a filesystem run one at a time
                failure = fs.failed.get(ticket)
            finally:
                self._writing += 1
                fs.waiting[ticket] -= 1
                if not fs.waiting[ticket]:
                    del fs.waiting[ticket]
                    fs.failed.pop(ticket, None)
        if failure is not None:
            raise OSError(failure.errno, f"syncing the files written: {failure.strerror}")

    def _run(self, fs: _Filesystem, fd: int) -> None:
        """Sync the filesystem for everyone waiting on it (called, and returning, with the lock held),
        once the writers still on their way got here or ``gather_s`` passed."""
        assert self._syncfs is not None
        fs.running = True
        deadline = time.monotonic() + self.gather_s
        while self._writing > 0 and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)
        fs.started += 1
        generation = fs.started
        error: OSError | None = OSError(errno.EIO, "the sync was interrupted")
        self._cond.release()
        try:
            self._syncfs(fd)
            error = None
        except OSError as exc:
            error = exc
        finally:
            self._cond.acquire()
            fs.running = False
            fs.done = generation
            self.syncs += 1
            if error is not None:
                fs.failed[generation] = error
            self._cond.notify_all()


PROCESS_SYNC = GroupSync(libc_syncfs())
"""The syncs this process's local backends share."""
