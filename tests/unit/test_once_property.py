"""once_property: the runtime's components are built once per process, whichever threads read first."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omni_jobs.core.once import once_property

READERS = 32


class Built:
    def __init__(self) -> None:
        self.builds: list[str] = []

    @once_property
    def slow(self) -> object:
        """Slow enough that every reader arrives while the first build runs."""
        self.builds.append("slow")
        time.sleep(0.05)
        return object()

    @once_property
    def outer(self) -> tuple[object, object]:
        self.builds.append("outer")
        return (self.inner, self.slow)  # a builder reads its instance's other properties

    @once_property
    def inner(self) -> object:
        self.builds.append("inner")
        return object()


def read_at_once(read: object) -> list[object]:
    barrier = threading.Barrier(READERS)

    def reader(_: int) -> object:
        barrier.wait()
        return read()  # type: ignore[operator]

    with ThreadPoolExecutor(READERS) as pool:
        return list(pool.map(reader, range(READERS)))


def test_threads_racing_for_the_first_read_share_one_build() -> None:
    obj = Built()
    seen = read_at_once(lambda: obj.slow)
    assert obj.builds == ["slow"]
    assert all(value is seen[0] for value in seen)
    assert obj.slow is seen[0]


def test_a_builder_reads_the_other_properties_and_each_is_built_once() -> None:
    obj = Built()
    seen = read_at_once(lambda: obj.outer)
    assert sorted(obj.builds) == ["inner", "outer", "slow"]
    assert all(value is seen[0] for value in seen)
    assert seen[0] == (obj.inner, obj.slow)


def test_instances_are_apart_and_del_builds_again() -> None:
    a, b = Built(), Built()
    assert a.inner is not b.inner
    first = a.inner
    del a.inner
    assert a.inner is not first
    assert a.builds == ["inner", "inner"] and b.builds == ["inner"]
    assert isinstance(Built.__dict__["slow"], once_property) and Built.slow.__doc__ is not None


def test_a_workers_first_burst_gets_one_executor_and_one_webhook_deliverer(tmp_path: Path) -> None:
    """What a stage worker's threads read on their first tasks (no service is touched to build them)."""
    from omni_jobs.core.settings import Settings
    from omni_jobs.runtime import Runtime

    rt = Runtime(Settings(redis_url="redis://unused:1/0", artifacts_dir=tmp_path, engine_turns="off"))
    executors = read_at_once(lambda: rt.executor)
    assert all(e is rt.executor for e in executors)
    assert rt.executor.webhooks is rt.webhooks and rt.executor.stages is rt.stage_runner
