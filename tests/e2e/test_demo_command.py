"""The README's first command, as a newcomer runs it: `omni-jobs up` starts everything and runs a job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from PIL import Image

from omni_jobs.local.devservices import free_port

REPO = Path(__file__).resolve().parents[2]


def test_up_once_runs_a_text_to_image_job_and_stops_everything(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    env["OMNI_MODELS_DIR"] = str(REPO / "var" / "models")
    home = tmp_path / "home"
    proc = subprocess.run(
        [sys.executable, "-m", "omni_jobs.cli", "up", "--once", "--home", str(home),
         "--api-port", str(free_port()), "--flower-port", str(free_port()), "--prompt", "a small red boat"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400, check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert re.search(r"started Redis at redis://127\.0\.0\.1:\d+/0", out)
    assert re.search(r"API: +http://127\.0\.0\.1:\d+ +\(docs: http://127\.0\.0\.1:\d+/docs\)", out)
    assert re.search(r"Flower: +http://127\.0\.0\.1:\d+ +\(user admin, password \S+\)", out)
    assert re.search(rf"CLI: +\. {re.escape(str((home / 'env').resolve()))} ", out)
    assert not (home / "env").exists()  # gone with the system it pointed at
    png_path = Path(re.search(r"image: +(\S+\.png)", out).group(1))  # type: ignore[union-attr]
    json_path = Path(re.search(r"job JSON: +(\S+\.json)", out).group(1))  # type: ignore[union-attr]
    job = json.loads(json_path.read_text())
    assert job["status"] == "succeeded" and job["input"] == {"prompt": "a small red boat"}
    with Image.open(png_path) as image:
        assert image.format == "PNG" and image.size == (64, 64)
    assert [s["id"] for s in job["stages"]] == ["ar", "dit"]
    # The job's outputs are kept in its home, beside the Redis data that points at them (not under the cwd).
    kept = [p for p in (home / "artifacts").rglob("*") if p.is_file() and job["id"] in str(p)]
    assert any(p.stat().st_size > 0 for p in kept), sorted((home / "artifacts").rglob("*"))
    # Everything it started is gone: no process still runs from its Redis data dir or logs.
    leftover = subprocess.run(["pgrep", "-f", str(home)], check=False, capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout
