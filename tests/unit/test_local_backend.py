"""LocalBackend: atomic files under a root, keys that cannot escape it, prefix deletes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from omni_jobs.artifacts import ArtifactBackend, ArtifactNotFound, InvalidArtifactKey, LocalBackend


@pytest.fixture
def backend(tmp_path: Path) -> LocalBackend:
    return LocalBackend(tmp_path / "artifacts")


def test_is_an_artifact_backend(backend: LocalBackend) -> None:
    assert isinstance(backend, ArtifactBackend)
    assert backend.name == "local"


def test_round_trip_overwrite_and_empty(backend: LocalBackend) -> None:
    data = bytes(range(256)) * 10
    backend.put("jobs/j1/stages/ar/ids", data, ttl_s=60)
    assert backend.get("jobs/j1/stages/ar/ids") == data
    backend.put("jobs/j1/stages/ar/ids", b"new", ttl_s=None)
    assert backend.get("jobs/j1/stages/ar/ids") == b"new"
    backend.put("jobs/j1/empty", b"")
    assert backend.get("jobs/j1/empty") == b""
    assert backend.path("jobs/j1/empty") == backend.root / "jobs" / "j1" / "empty"


def test_missing_key_names_the_key(backend: LocalBackend) -> None:
    with pytest.raises(ArtifactNotFound, match="jobs/nope/x") as info:
        backend.get("jobs/nope/x")
    assert info.value.key == "jobs/nope/x" and info.value.backend == "local"
    backend.put("jobs/j/dir/file", b"x")
    with pytest.raises(ArtifactNotFound):
        backend.get("jobs/j/dir")  # a directory is not an artifact


def test_exists_and_idempotent_delete(backend: LocalBackend) -> None:
    assert not backend.exists("jobs/j/a")
    backend.put("jobs/j/a", b"1")
    assert backend.exists("jobs/j/a")
    backend.delete("jobs/j/a")
    backend.delete("jobs/j/a")
    assert not backend.exists("jobs/j/a")
    assert not (backend.root / "jobs").exists()  # empty directories are pruned


def test_delete_prefix_is_a_string_prefix_and_leaves_others(backend: LocalBackend) -> None:
    for key in ["jobs/j1/a", "jobs/j1/stages/dit/latents", "jobs/j10/a", "jobs/j2/a", "other/j1/a"]:
        backend.put(key, b"x")
    assert backend.delete_prefix("jobs/j1/") == 2
    assert not backend.exists("jobs/j1/a") and backend.exists("jobs/j10/a")
    assert not (backend.root / "jobs" / "j1").exists()
    assert backend.delete_prefix("jobs/j") == 2
    assert backend.exists("other/j1/a")
    assert backend.delete_prefix("jobs/missing/") == 0
    assert backend.delete_prefix("nothing-here") == 0


@pytest.mark.parametrize(
    "key", ["", "/etc/passwd", "../escape", "jobs/../../escape", "jobs//x", "jobs/./x", "jobs/x/", "a\\b", "a\x00b"]
)
def test_rejects_keys_that_escape_or_are_malformed(backend: LocalBackend, key: str) -> None:
    for call in (lambda: backend.put(key, b"x"), lambda: backend.get(key), lambda: backend.exists(key)):
        with pytest.raises(InvalidArtifactKey):
            call()
    assert not (backend.root.parent / "escape").exists()


def test_rejects_keys_escaping_through_a_symlink(backend: LocalBackend, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    backend.root.mkdir(parents=True)
    os.symlink(outside, backend.root / "link")
    with pytest.raises(InvalidArtifactKey, match="outside"):
        backend.put("link/file", b"x")
    assert not any(outside.iterdir())


def test_refuses_empty_prefix_and_bad_ttl(backend: LocalBackend) -> None:
    with pytest.raises(InvalidArtifactKey, match="empty prefix"):
        backend.delete_prefix("")
    with pytest.raises(InvalidArtifactKey):
        backend.delete_prefix("/")
    with pytest.raises(ValueError, match="ttl_s"):
        backend.put("jobs/j/a", b"x", ttl_s=0)


def test_no_presigned_urls(backend: LocalBackend) -> None:
    backend.put("jobs/j/a", b"x")
    assert backend.presigned_url("jobs/j/a", expires_s=60, filename="a.png") is None


def test_writes_are_atomic_under_concurrent_writers(backend: LocalBackend) -> None:
    """Readers see one complete version, never a mix, and no temp files stay behind."""
    payloads = [bytes([i]) * 200_000 for i in range(8)]
    seen: list[bytes] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                seen.append(backend.get("jobs/j/blob"))
            except ArtifactNotFound:
                pass

    r = threading.Thread(target=reader)
    r.start()
    writers = [threading.Thread(target=backend.put, args=("jobs/j/blob", p)) for p in payloads for _ in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    r.join()
    assert backend.get("jobs/j/blob") in payloads
    assert all(s in payloads for s in seen)
    assert sorted(p.name for p in (backend.root / "jobs" / "j").iterdir()) == ["blob"]


def test_a_killed_writers_temp_file_goes_with_the_next_write(backend: LocalBackend) -> None:
    """A writer killed before its replace leaves ``.name.<id>.omni-tmp``; the next successful write of
    the key removes it, but not a temp file another writer is still writing (touched since)."""
    backend.put("jobs/j/image.png", b"first")
    folder = backend.root / "jobs" / "j"
    abandoned = folder / ".image.png.0123abcd.omni-tmp"
    abandoned.write_bytes(b"half")
    os.utime(abandoned, (1_000_000_000, 1_000_000_000))  # last touched long before the next write
    writing = folder / ".image.png.4567ef01.omni-tmp"
    writing.write_bytes(b"still")
    os.utime(writing, (4_000_000_000, 4_000_000_000))  # touched after the next write began
    other = folder / ".text.json.89abcdef.omni-tmp"
    other.write_bytes(b"another key's")
    os.utime(other, (1_000_000_000, 1_000_000_000))
    backend.put("jobs/j/image.png", b"second")
    assert backend.get("jobs/j/image.png") == b"second"
    assert sorted(p.name for p in folder.iterdir()) == [".image.png.4567ef01.omni-tmp", ".text.json.89abcdef.omni-tmp",
                                                          "image.png"]


def test_a_symlink_that_stays_inside_the_root_is_followed(backend: LocalBackend) -> None:
    (backend.root / "real").mkdir(parents=True)
    os.symlink(backend.root / "real", backend.root / "alias")
    backend.put("alias/j/a.png", b"x")
    assert (backend.root / "real" / "j" / "a.png").read_bytes() == b"x"
    assert backend.get("alias/j/a.png") == b"x" and backend.path("alias/j/a.png") == backend.root / "real/j/a.png"


def test_the_symlink_guard_looks_only_below_the_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new job's output costs the same few system calls however deep the root is: each one hands the
    interpreter's lock away, in a worker where 32 threads write a batch's outputs at once."""
    backend = LocalBackend(tmp_path.joinpath(*"abcdefghij") / "artifacts")
    backend.put("jobs/first/a.png", b"1")
    looked: list[str] = []
    real_lstat = os.lstat
    monkeypatch.setattr(os, "lstat", lambda p, *a, **k: looked.append(str(p)) or real_lstat(p, *a, **k))
    backend.put("jobs/second/outputs/a.png", b"2")
    assert looked == [f"{backend.root}/jobs", f"{backend.root}/jobs/second"]
    assert backend.get("jobs/second/outputs/a.png") == b"2"
