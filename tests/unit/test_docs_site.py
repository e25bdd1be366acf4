"""The docs site builds: `mkdocs build --strict` on mkdocs.yml, so a broken link or anchor fails the run.

mkdocs-material comes with the test extras (pyproject.toml); the build reaches no network (no web
fonts, no plugin that fetches anything), and writes into a temporary directory, not the checkout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("material", reason="mkdocs-material is in the test extras: scripts/bootstrap installs it")


def test_the_site_builds_with_strict_links(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (site / "index.html").is_file()
    shutil.rmtree(site)


def test_every_page_is_in_the_nav_and_no_page_links_outside_the_repo() -> None:
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    missing = [p for p in pages if p not in config]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"
    outside = [
        f"{p}: {m}"
        for p in pages
        for m in re.findall(r"\]\((https?://[^)]+)\)", (ROOT / "docs" / p).read_text(encoding="utf-8"))
    ]
    assert not outside, f"links outside the repository: {outside}"
