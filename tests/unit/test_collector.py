"""omni_jobs.core.collector: what is alive when a worker's engines are loaded leaves the collector's
passes, and what the jobs make afterwards is still collected; the API's young generation."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from omni_jobs.core.collector import freeze_loaded_objects, set_young_threshold


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the suite runs with the collector as it was


def _cycle() -> Node:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


def _walked() -> set[int]:
    """Ids of the objects a collection walks: those in the collector's generations."""
    return {id(o) for o in gc.get_objects()}


@pytest.mark.usefixtures("unfrozen")
def test_a_full_pass_no_longer_walks_what_was_loaded() -> None:
    loaded = [{"weight": i, "module": [i]} for i in range(300_000)]  # an engine's many small objects
    assert {id(loaded), id(loaded[0]), id(loaded[-1]["module"])} <= _walked()
    frozen = freeze_loaded_objects()
    assert frozen >= 600_000  # the dicts and lists above, at least
    made_after = [Node()]
    walked = _walked()
    assert not {id(loaded), id(loaded[0]), id(loaded[-1]["module"])} & walked
    assert {id(made_after), id(made_after[0])} <= walked  # what the jobs make is walked as before
    gc.unfreeze()
    assert id(loaded[0]) in _walked()  # unfrozen, back in the oldest generation


@pytest.mark.usefixtures("unfrozen")
def test_garbage_made_after_the_freeze_is_still_collected() -> None:
    freeze_loaded_objects()
    for _ in range(100):
        _cycle()  # a job's garbage: cycles only the collector frees
    gc.collect()
    assert not any(type(o) is Node for o in gc.get_objects())  # the 100 cycles are gone


@pytest.mark.usefixtures("unfrozen")
def test_what_loading_left_as_garbage_is_collected_before_the_freeze() -> None:
    for _ in range(100):
        _cycle()  # garbage cycles left by a load, not yet collected
    freeze_loaded_objects()
    gc.unfreeze()  # what was frozen goes back to the collector's oldest generation
    assert not any(type(o) is Node for o in gc.get_objects())  # none of it was frozen


@pytest.fixture
def thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


@pytest.mark.usefixtures("thresholds")
def test_the_young_generation_waits_for_its_threshold_and_the_older_ones_keep_pythons() -> None:
    gc.set_threshold(700, 10, 10)
    set_young_threshold(20_000)
    assert gc.get_threshold() == (20_000, 10, 10)
    gc.collect()
    young_collections = gc.get_stats()[0]["collections"]
    kept = [[i] for i in range(5_000)]  # 5,000 container objects made, none freed: under 20,000
    assert gc.get_stats()[0]["collections"] == young_collections
    assert len(kept) == 5_000
    set_young_threshold(0)  # 0 leaves the threshold as it is
    assert gc.get_threshold() == (20_000, 10, 10)
