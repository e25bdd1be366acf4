"""What a worker process sets for its engine libraries before they load (workers/app.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRINT = ("import sys, workers.app, os; assert 'torch' not in sys.modules, 'torch loaded before the setting'; "
         "print(os.environ[sys.argv[1]])")


def seen_by_torch(name: str, env: dict[str, str]) -> str:
    """The value of ``name`` in a process that imported workers.app (and not yet torch)."""
    out = subprocess.run([sys.executable, "-c", PRINT, name], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


@pytest.mark.parametrize(("name", "default", "users"), [
    ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128", "1024"),  # oneDNN's compiled matmuls, bounded (memory)
    ("GOMP_SPINCOUNT", "20000", "300000"),  # OpenMP's spin before sleeping at a barrier, bounded (CPU)
])
def test_a_worker_sets_its_engine_libraries_defaults_unless_told_otherwise(name: str, default: str,
                                                                         users: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != name}
    assert seen_by_torch(name, env) == default
    assert seen_by_torch(name, {**env, name: users}) == users


def test_a_workers_switch_interval_is_pythons_unless_set() -> None:
    show = "import sys, workers.app; print(sys.getswitchinterval())"
    env = {k: v for k, v in os.environ.items() if k != "OMNI_WORKER_SWITCH_INTERVAL_MS"}

    def interval(extra: dict[str, str]) -> float:
        run = subprocess.run([sys.executable, "-c", show], cwd=REPO, env={**env, **extra}, capture_output=True,
                             text=True, check=True)
        return float(run.stdout.strip())

    assert interval({}) == 0.005  # Python's own
    assert interval({"OMNI_WORKER_SWITCH_INTERVAL_MS": "1"}) == 0.001


def test_the_benchmarks_direct_arm_gets_the_same_engine_library_settings() -> None:
    from omni_jobs.engines.library_env import ENGINE_LIBRARY_DEFAULTS, apply_engine_library_defaults

    env = apply_engine_library_defaults({"PATH": "/bin", "GOMP_SPINCOUNT": "5"})
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": "5",  # the caller's own value stays
                   "ONEDNN_PRIMITIVE_CACHE_CAPACITY": ENGINE_LIBRARY_DEFAULTS["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]}
