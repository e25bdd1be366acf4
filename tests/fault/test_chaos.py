"""The chaos run under pytest (marker ``chaos``: minutes long, so not in the default run).

    scripts/test -m chaos tests/fault/test_chaos.py -s

Everything it asserts, and how it counts, is in tests/fault/chaos.py, which also runs on its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fault import chaos

pytestmark = pytest.mark.chaos


def test_chaos_loses_nothing_and_duplicates_nothing(tmp_path: Path) -> None:
    result = chaos.run(jobs=200, seed=7, home=tmp_path / "chaos")
    print("\n" + result.table())
    assert len(result.accepted) == 200
    assert result.succeeded == len(result.accepted), result.table()
    assert result.missing == [], result.table()
    assert (result.duplicate_runs, result.duplicate_webhooks, result.missing_webhooks,
            result.duplicate_files) == (0, 0, 0, 0), result.table()
    assert result.last_done_after_last_fault_s <= chaos.DONE_WITHIN_S, result.table()
