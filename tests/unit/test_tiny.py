"""The cheap parts of omni_jobs.local.tiny: name resolution, errors, and the race-safe ensure."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from omni_jobs.local import tiny


@pytest.mark.parametrize("model", ["org/some-model", "/abs/path/model", "relative/dir", "gpt2"])
def test_resolve_model_passthrough(model: str, tmp_path: Path) -> None:
    assert tiny.resolve_model(model, tmp_path) == model
    assert list(tmp_path.iterdir()) == []  # nothing built


def test_unknown_name_lists_valid_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama.*pixart"):
        tiny.ensure_tiny_model("nope", tmp_path)
    with pytest.raises(ValueError, match="unknown tiny model 'nope'"):
        tiny.resolve_model("tiny:nope", tmp_path)


def _fake_builder(calls: list[str], barrier: threading.Barrier | None = None):  # type: ignore[no-untyped-def]
    def build(path: Path) -> Path:
        calls.append(str(path))
        if barrier is not None:
            barrier.wait(timeout=10)  # make every caller build before anyone renames
        path.mkdir(parents=True, exist_ok=True)
        (path / "weights.bin").write_text(str(path))
        return path

    return build


def test_ensure_builds_once_and_is_idempotent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setitem(tiny.TINY_MODELS, "fake", _fake_builder(calls))
    first = tiny.ensure_tiny_model("fake", tmp_path)
    assert first == tmp_path / "tiny-fake"
    assert tiny.ensure_tiny_model("fake", tmp_path) == first
    assert tiny.resolve_model("tiny:fake", tmp_path) == str(first)
    assert len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-fake"]  # no temp dir left behind
    assert oct(first.stat().st_mode & 0o777) == oct(0o755)  # readable by other users' workers


def test_ensure_concurrent_callers_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 4
    calls: list[str] = []
    monkeypatch.setitem(tiny.TINY_MODELS, "fake", _fake_builder(calls, threading.Barrier(n)))
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(tiny.ensure_tiny_model("fake", tmp_path))) for _ in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == n  # everyone built...
    assert results == [tmp_path / "tiny-fake"] * n  # ...and everyone got the one winner
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-fake"]
    assert (tmp_path / "tiny-fake" / "weights.bin").read_text() in calls


def test_cli_prints_built_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(tiny.TINY_MODELS, "fake", _fake_builder([]))
    assert tiny.main(["build", "--out", str(tmp_path), "--name", "fake"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "tiny-fake")


def test_ensure_llama_is_idempotent(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    path = tiny.ensure_tiny_model("llama", tmp_path)
    assert (path / "model.safetensors").is_file()
    assert (path / "tokenizer.json").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_tiny_model("llama", tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
