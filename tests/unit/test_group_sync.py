"""GroupSync: concurrent writers share a filesystem sync, each covered by one that began after its write."""

from __future__ import annotations

import errno
import itertools
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from omni_jobs.artifacts import ArtifactStoreUnavailable, LocalBackend
from omni_jobs.artifacts.backends.group_sync import GroupSync, libc_syncfs


class RecordedSyncs:
    """A stand-in for syncfs that takes ``seconds`` and records when each call began and ended."""

    def __init__(self, seconds: float, fail_first: int = 0) -> None:
        self.seconds = seconds
        self.fail_first = fail_first
        self.spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def __call__(self, fd: int) -> None:
        began = time.monotonic()
        time.sleep(self.seconds)
        with self._lock:
            self.spans.append((began, time.monotonic()))
            failing = len(self.spans) <= self.fail_first
        if failing:
            raise OSError(errno.EIO, "I/O error")


def write_and_sync(group: GroupSync, fd: int, arrive_after_s: float, seen: list[tuple[float, float, str]]) -> None:
    with group.writing():
        time.sleep(arrive_after_s)  # writing
        asked = time.monotonic()
        try:
            group.sync(fd)
            outcome = "ok"
        except OSError as exc:
            outcome = f"error {exc.errno}"
        seen.append((asked, time.monotonic(), outcome))


def run_writers(group: GroupSync, fd: int, arrivals: list[float]) -> list[tuple[float, float, str]]:
    seen: list[tuple[float, float, str]] = []
    threads = [threading.Thread(target=write_and_sync, args=(group, fd, a, seen)) for a in arrivals]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(seen) == len(arrivals)
    return seen


def test_a_burst_of_writers_shares_a_few_syncs_each_begun_after_its_write(tmp_path: Path) -> None:
    syncs = RecordedSyncs(0.02)
    group = GroupSync(syncs, gather_s=0.005)
    with open(tmp_path / "f", "wb") as fh:
        seen = run_writers(group, fh.fileno(), [0.001 * (i % 8) for i in range(24)])
    assert all(outcome == "ok" for _, _, outcome in seen)
    assert 1 <= len(syncs.spans) <= 6, syncs.spans  # one each would be 24
    assert group.syncs == len(syncs.spans)
    for asked, returned, _ in seen:  # what covers a writer is a whole sync within its wait
        assert any(asked <= began and ended <= returned for began, ended in syncs.spans), (asked, returned)


def test_syncs_of_a_filesystem_never_overlap(tmp_path: Path) -> None:
    syncs = RecordedSyncs(0.01)
    group = GroupSync(syncs, gather_s=0.0)
    with open(tmp_path / "f", "wb") as fh:
        run_writers(group, fh.fileno(), [0.003 * i for i in range(20)])
    spans = sorted(syncs.spans)
    assert all(prev_end <= began for (_, prev_end), (began, _) in itertools.pairwise(spans))


def test_a_lone_writer_does_not_wait_to_gather(tmp_path: Path) -> None:
    group = GroupSync(RecordedSyncs(0.0), gather_s=2.0)
    with open(tmp_path / "f", "wb") as fh:
        (asked, returned, outcome), = run_writers(group, fh.fileno(), [0.0])
    assert outcome == "ok" and returned - asked < 0.5


def test_a_failed_sync_fails_the_writers_it_covered_and_the_next_one_serves_the_rest(tmp_path: Path) -> None:
    syncs = RecordedSyncs(0.05, fail_first=1)
    group = GroupSync(syncs, gather_s=0.0)
    with open(tmp_path / "f", "wb") as fh:
        first = run_writers(group, fh.fileno(), [0.0])
        assert first[0][2] == f"error {errno.EIO}"
        later = run_writers(group, fh.fileno(), [0.0, 0.0, 0.01])
    assert all(outcome == "ok" for _, _, outcome in later)
    assert len(syncs.spans) >= 2


def test_writers_already_waiting_share_the_failure_of_the_sync_that_covers_them(tmp_path: Path) -> None:
    syncs = RecordedSyncs(0.1, fail_first=2)
    group = GroupSync(syncs, gather_s=0.0)
    with open(tmp_path / "f", "wb") as fh:
        # The first sync runs alone; the three who ask while it runs share the second, which also fails.
        seen = run_writers(group, fh.fileno(), [0.0, 0.03, 0.04, 0.05])
    assert sorted(outcome for _, _, outcome in seen) == [f"error {errno.EIO}"] * 4
    assert len(syncs.spans) == 2


def test_without_syncfs_each_writer_fsyncs_its_own_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    group = GroupSync(None)
    assert not group.shared
    with open(tmp_path / "f", "wb") as fh:
        run_writers(group, fh.fileno(), [0.0, 0.0, 0.0])
        assert synced == [fh.fileno()] * 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="syncfs is Linux's")
def test_local_backend_writes_concurrently_through_real_syncfs(tmp_path: Path) -> None:
    syncfs = libc_syncfs()
    assert syncfs is not None
    group = GroupSync(syncfs)
    backend = LocalBackend(tmp_path / "artifacts", sync=group)
    payloads = {f"jobs/job_{i}/outputs/image.png": os.urandom(2000 + i) for i in range(16)}
    threads = [threading.Thread(target=backend.put, args=(key, data)) for key, data in payloads.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {key: backend.get(key) for key in payloads} == payloads
    assert 1 <= group.syncs <= 16
    assert not [p for p in (tmp_path / "artifacts").rglob("*") if p.name.endswith(".omni-tmp")]


def test_a_failed_sync_is_a_transient_store_error(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "artifacts", sync=GroupSync(RecordedSyncs(0.0, fail_first=1)))
    with pytest.raises(ArtifactStoreUnavailable):
        backend.put("jobs/j/outputs/a.png", b"png")
    backend.put("jobs/j/outputs/a.png", b"png")  # the retry of the stage writes it again
    assert backend.get("jobs/j/outputs/a.png") == b"png"
