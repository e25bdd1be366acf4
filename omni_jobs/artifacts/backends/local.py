"""Local-directory backend: outputs and large intermediates on one machine (demo, tests, NFS).

Writes are atomic (temp file in the same directory, os.replace), so a reader never sees a
half-written artifact, even when a stage is retried while another copy of it is still writing, and
durable before ``put`` returns: a sync shared with the writers beside it (group_sync), where Linux
has ``syncfs``; else an fsync of the file. A writer killed before its replace
leaves its temp file behind; the next write of the same key that succeeds removes the ones last
touched before it began (a later attempt's write: the chaos run found two such files among 200
jobs), and retention removes any still left.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from omni_jobs.artifacts.backends.base import (
    ArtifactError,
    ArtifactNotFound,
    ArtifactStoreUnavailable,
    InvalidArtifactKey,
    PutItem,
    check_ttl,
    put_each,
    validate_key,
    validate_prefix,
)
from omni_jobs.artifacts.backends.group_sync import PROCESS_SYNC, GroupSync
from omni_jobs.artifacts.refs import BackendName

_TMP_SUFFIX = ".omni-tmp"
_WRITER = uuid.uuid4().hex[:8]
"""Tells this process's temp files from another host's with the same pid (a shared directory, NFS)."""
_TEMP_NUMBERS = itertools.count()
_TRANSIENT_ERRNOS = {errno.ENOSPC, errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.EDQUOT}


def _remove_abandoned(path: Path, began: float) -> None:
    """Remove the temp files of ``path`` that no write touched since ``began``: left by writers killed
    before their replace (an earlier attempt). A writer still writing keeps touching its own.
    (One scandir of the directory: pathlib's glob cost ~0.1 ms of Python per write.)"""
    prefix = f".{path.name}."
    with os.scandir(path.parent) as entries:
        for entry in entries:
            if not (entry.name.startswith(prefix) and entry.name.endswith(_TMP_SUFFIX)):
                continue
            try:
                if entry.stat().st_mtime < began:
                    os.unlink(entry.path)
            except FileNotFoundError:
                continue


def _temp_path(path: Path) -> Path:
    """A name no other writer uses: the process (pid, and ``_WRITER`` for other hosts) and a count,
    with no system call (``uuid4`` reads the kernel's random numbers on every write)."""
    return path.with_name(f".{path.name}.{os.getpid():x}-{_WRITER}-{next(_TEMP_NUMBERS)}{_TMP_SUFFIX}")


def _os_error(operation: str, key: str, exc: OSError) -> ArtifactError:
    if exc.errno in _TRANSIENT_ERRNOS:
        return ArtifactStoreUnavailable("local", operation, key, exc)
    return ArtifactError(f"local backend failed to {operation} {key!r}: {exc}")


class LocalBackend:
    """Artifacts as files under ``root``; TTLs are not enforced (``delete_job`` cleans up)."""

    def __init__(self, root: Path | str, *, name: BackendName = "local", sync: GroupSync = PROCESS_SYNC) -> None:
        # ``name`` lets a test stand a directory in for another backend (e.g. routing tests).
        self._root = Path(root).resolve()
        self._root_text = str(self._root).rstrip("/")  # "" for "/": every path below is f"{it}/{key}"
        self._name: BackendName = name
        self._sync = sync

    @property
    def name(self) -> BackendName:
        return self._name

    @property
    def root(self) -> Path:
        return self._root

    def path(self, key: str) -> Path:
        """The file that holds ``key`` (for serving it directly); refuses keys escaping the root."""
        return self._locate(key)[0]

    def _locate(self, key: str) -> tuple[Path, int | None]:
        """``key``'s file, and how many of its directories exist already, from the root down (None:
        not known, a symlink was followed). Refuses keys escaping the root.

        Only what is below the (resolved) root is checked, one ``lstat`` a part, down to the first
        part missing: with no symlink on the way the file is inside the root. A symlink sends the key
        to a full ``resolve()`` and its check. ``resolve()`` on every call lstat-ed every part from
        ``/`` down (~10 system calls an output), and each system call gives the interpreter's lock
        away: in a DiT worker finishing a batch of 32 at once, 0.48 ms of CPU an output."""
        validate_key(key)
        parts = key.split("/")
        current = self._root_text
        for index, part in enumerate(parts):
            current = f"{current}/{part}"
            try:
                mode = os.lstat(current).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return Path(f"{self._root_text}/{key}"), min(index, len(parts) - 1)
            if stat.S_ISLNK(mode):
                path = (self._root / key).resolve()
                if not path.is_relative_to(self._root):
                    raise InvalidArtifactKey(f"artifact key {key!r} resolves outside {self._root} (via a symlink)")
                return path, None
        return Path(current), len(parts) - 1

    def _make_parents(self, key: str, path: Path, existing: int | None) -> bool:
        """Make the directories of ``key`` that ``_locate`` found missing; returns whether this call
        made the file's own directory (then no earlier writer can have left a temp file in it)."""
        if existing is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            return False
        parts = key.split("/")[:-1]
        made = False
        for depth in range(existing, len(parts)):
            try:
                os.mkdir(f"{self._root_text}/{'/'.join(parts[:depth + 1])}")
                made = True
            except FileExistsError:  # another writer made it meanwhile
                made = False
            except FileNotFoundError:  # the root itself is missing, or a delete pruned a parent meanwhile
                path.parent.mkdir(parents=True, exist_ok=True)
                return False
        return made

    def put(self, key: str, data: bytes, *, ttl_s: int | None = None, media_type: str | None = None) -> None:
        check_ttl(ttl_s)
        path, existing = self._locate(key)
        tmp = _temp_path(path)
        began = time.time()
        for attempt in range(3):
            try:
                made_directory = self._make_parents(key, path, existing)
                # Plain descriptor calls: open() adds an fstat, an ioctl and an lseek a file, each a
                # system call that hands the interpreter's lock away.
                with self._sync.writing():
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
                    try:
                        view = memoryview(data)
                        while view:
                            view = view[os.write(fd, view):]
                        os.replace(tmp, path)
                        self._sync.sync(fd)  # shared with the writers beside it (group_sync)
                    finally:
                        os.close(fd)
                if not made_directory:
                    _remove_abandoned(path, began)
                return
            except FileNotFoundError as exc:
                # A concurrent delete pruned the (empty) parent between mkdir and open: redo.
                tmp.unlink(missing_ok=True)
                existing = None  # what was found is stale: make every directory again
                if attempt == 2:
                    raise _os_error("put", key, exc) from exc
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                raise _os_error("put", key, exc) from exc

    def put_many(self, items: Sequence[PutItem], *, ttl_s: int | None = None) -> None:
        put_each(self, items, ttl_s=ttl_s)

    def get(self, key: str) -> bytes:
        path = self.path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise ArtifactNotFound(key, "local", f"no file at {path}") from exc
        except OSError as exc:
            raise _os_error("get", key, exc) from exc

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> None:
        path = self.path(key)
        try:
            path.unlink(missing_ok=True)
        except IsADirectoryError:
            return
        except OSError as exc:
            raise _os_error("delete", key, exc) from exc
        self._prune_empty_dirs(path.parent)

    def delete_prefix(self, prefix: str) -> int:
        """Delete files whose key starts with ``prefix`` (a string prefix, as in S3 and Redis)."""
        validate_prefix(prefix)
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self._root / base_rel
        if not base.resolve().is_relative_to(self._root) or not base.is_dir():
            return 0
        deleted = 0
        dirs: set[Path] = set()
        try:
            for dirpath, _dirnames, filenames in os.walk(base):
                for fname in filenames:
                    if fname.endswith(_TMP_SUFFIX):
                        continue
                    full = Path(dirpath) / fname
                    if full.relative_to(self._root).as_posix().startswith(prefix):
                        full.unlink(missing_ok=True)
                        deleted += 1
                        dirs.add(full.parent)
        except OSError as exc:
            raise _os_error("delete_prefix", prefix, exc) from exc
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            self._prune_empty_dirs(d)
        return deleted

    def presigned_url(self, key: str, *, expires_s: int, filename: str | None = None) -> str | None:
        validate_key(key)
        return None

    def _prune_empty_dirs(self, start: Path) -> None:
        """Remove now-empty directories up to (not including) the root; races are harmless."""
        current = start
        while current != self._root and current.is_relative_to(self._root):
            try:
                current.rmdir()
            except OSError:
                return
            current = current.parent
