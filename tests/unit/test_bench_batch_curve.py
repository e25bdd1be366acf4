"""bench.batch_curve's reading of an engine's batch times: least times, time per image, the fixed cost."""

from __future__ import annotations

import pytest

from bench.batch_curve import report, row_target, summary
from bench.run import DIT_LARGE, DIT_SMALL


def test_each_size_is_its_least_time_and_the_fit_is_the_batchers() -> None:
    s = summary({8: [0.94, 1.20], 16: [1.62, 1.70], 32: [2.63, 2.90]})
    assert s["least_s"] == {8: 0.94, 16: 1.62, 32: 2.63}
    assert s["ms_per_image"][8] == pytest.approx(117.5) and s["ms_per_image"][32] == pytest.approx(82.2, abs=0.1)
    assert s["fixed_s"] == pytest.approx(0.435, abs=0.005)
    assert "what a part batch wastes" in report("small", s)


def test_a_linear_engine_has_no_fixed_cost_and_a_part_batch_costs_nothing() -> None:
    s = summary({4: [1.16, 1.20], 16: [4.57], 32: [9.28, 9.50]})
    assert s["fixed_s"] == 0.0
    text = report("large", s)
    assert "| 4 | 1.160 | 290.0 | 1.00x |" in text and "a part batch costs about nothing" in text


def test_one_size_leaves_the_fixed_cost_unknown() -> None:
    s = summary({32: [1.8, 1.9]})
    assert s["fixed_s"] is None and "unknown (give two batch sizes or more)" in report("one", s)


def test_rows_name_the_benchmarks_dit_workloads() -> None:
    assert row_target("small") == (DIT_SMALL, 32) and row_target("large") == (DIT_LARGE, 64)
    with pytest.raises(SystemExit, match="no DiT workload matches 'audio'"):
        row_target("audio")
