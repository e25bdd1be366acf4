"""What a worker process sets for its engine libraries before they load (workers/app.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRINT = ("import sys, workers.app, os; assert 'torch' not in sys.modules, 'torch loaded before the setting'; "
         "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])")


def capacity_seen(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", PRINT], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_a_worker_bounds_onednns_primitive_cache_unless_told_otherwise() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    assert capacity_seen(env) == "128"
    assert capacity_seen({**env, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}) == "1024"


def test_a_worker_hands_the_gil_on_sooner_than_python_does() -> None:
    show = "import sys, workers.app; print(sys.getswitchinterval())"
    env = {k: v for k, v in os.environ.items() if k != "OMNI_WORKER_SWITCH_INTERVAL_MS"}

    def interval(extra: dict[str, str]) -> float:
        run = subprocess.run([sys.executable, "-c", show], cwd=REPO, env={**env, **extra}, capture_output=True,
                             text=True, check=True)
        return float(run.stdout.strip())

    assert interval({}) == 0.001  # Python's own is 0.005
    assert interval({"OMNI_WORKER_SWITCH_INTERVAL_MS": "5"}) == 0.005
