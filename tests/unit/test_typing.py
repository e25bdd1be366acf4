"""Typing holds: ``mypy`` (pyproject's [tool.mypy]) passes, strict on all of omni_jobs.

omni_jobs/ is checked with the flags ``mypy --strict`` turns on, set per module in pyproject.toml (a
per-module section cannot say ``strict`` itself), every module of it: its CLI, its HTTP client and
omni_jobs/local/ (the embedded system and the tiny-model builders, which reach transformers' untyped
constructors through omni_jobs.local.untyped) included; api/ and workers/ keep mypy's default checks.
mypy keeps its cache in .mypy_cache: a cold run (a clean checkout) takes about a minute, a warm one a
few seconds.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STRICT_FLAGS = {
    "disallow_any_generics": True,
    "disallow_subclassing_any": True,
    "disallow_untyped_calls": True,
    "disallow_untyped_defs": True,
    "disallow_incomplete_defs": True,
    "check_untyped_defs": True,
    "disallow_untyped_decorators": True,
    "warn_unused_ignores": True,
    "warn_return_any": True,
    "implicit_reexport": False,
    "strict_equality": True,
    "extra_checks": True,
}
"""What --strict turns on (mypy --help), as config-file options; warn_unused_configs and
warn_redundant_casts are global-only, so they are set in [tool.mypy] itself."""


def _mypy_config() -> dict[str, object]:
    config: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]
    return config


def test_all_of_omni_jobs_is_configured_strict() -> None:
    config = _mypy_config()
    assert config.get("warn_unused_configs") is True and config.get("warn_redundant_casts") is True
    overrides = config["overrides"]
    assert isinstance(overrides, list)
    strict = [o for o in overrides if o["module"] == ["omni_jobs.*"]]
    assert len(strict) == 1, "one override makes every module under omni_jobs/ strict"
    assert {k: v for k, v in strict[0].items() if k != "module"} == STRICT_FLAGS
    relaxed = {m for o in overrides if o is not strict[0] for m in o["module"] if m.startswith("omni_jobs")}
    assert relaxed == set(), f"no module of omni_jobs may leave the strict checks; let off: {sorted(relaxed)}"


def test_mypy_passes() -> None:
    pytest.importorskip("mypy")
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=540,
                            check=False)
    assert result.returncode == 0, f"mypy failed:\n{result.stdout}{result.stderr}"
