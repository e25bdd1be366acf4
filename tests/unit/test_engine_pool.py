"""The engine pool builds and loads engines on threads that end with the load (omni_jobs.engines.pool):
no thread keeps an OpenMP team from torch work it will never do again."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest

from omni_jobs.engines import model_source, pool
from omni_jobs.engines.pool import EnginePool


class FakeDiT:
    """Stands in for DiTEngine's constructor (a diffusers load): records the thread it ran on."""

    loads: ClassVar[list[FakeDiT]] = []

    def __init__(self, model: str, **_: Any) -> None:
        self.model = model
        self.thread = threading.current_thread()
        FakeDiT.loads.append(self)


@pytest.fixture
def fake_engines(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    FakeDiT.loads = []
    monkeypatch.setattr(pool, "DiTEngine", FakeDiT)
    builds: list[threading.Thread] = []

    def build(name: str, models_dir: Path) -> str:
        builds.append(threading.current_thread())
        return str(models_dir / name)

    monkeypatch.setitem(model_source._SOURCES, "fake:", model_source.ModelSource("fake:", build))
    return builds


def test_engines_are_built_and_loaded_on_threads_that_end_with_the_load(
        fake_engines: list[threading.Thread], tmp_path: Path) -> None:
    engines = EnginePool(tmp_path, kv_cache_bytes=2**20, max_model_len=64, device="cpu")
    first = engines.dit("fake:pixart", {"pipeline_class": "PixArtSigmaPipeline"})
    again = engines.dit("fake:pixart", {"pipeline_class": "PixArtSigmaPipeline"})
    assert again is first and len(FakeDiT.loads) == 1  # loaded once
    assert first.model == str(tmp_path / "pixart")  # type: ignore[attr-defined]  # the fake's record
    (loader,) = [e.thread for e in FakeDiT.loads]
    (builder,) = fake_engines  # the model was built once too, not once per lookup
    for thread in (loader, builder):
        assert thread is not threading.current_thread()
        assert not thread.is_alive()


def test_a_failed_load_reaches_the_caller_and_the_next_lookup_tries_again(
        fake_engines: list[threading.Thread], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engines = EnginePool(tmp_path, kv_cache_bytes=2**20, max_model_len=64, device="cpu")

    class Broken(FakeDiT):
        def __init__(self, model: str, **_: Any) -> None:
            raise OSError(f"{model}: no model_index.json")

    monkeypatch.setattr(pool, "DiTEngine", Broken)
    with pytest.raises(OSError, match="pixart: no model_index.json"):
        engines.dit("fake:pixart", {})
    monkeypatch.setattr(pool, "DiTEngine", FakeDiT)
    assert isinstance(engines.dit("fake:pixart", {}), FakeDiT)
