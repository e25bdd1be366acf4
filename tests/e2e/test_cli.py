"""The ``omni-jobs`` job commands run as subprocesses against the running test system."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from PIL import Image

from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.helpers import wait_for_job

ROOT = Path(__file__).resolve().parents[2]
SLOW = ["--param", "dit.height=384", "--param", "dit.width=384", "--param", "dit.num_inference_steps=200"]


def omni(system: EmbeddedSystem, *args: str, timeout: float = 120, env: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    """``omni-jobs ARGS`` with the API chosen by OMNI_API_URL (as a user would set it)."""
    full_env = {**os.environ, "OMNI_API_URL": system.api_url, "OMNI_API_KEY": system.api_key or "", **(env or {})}
    return subprocess.run([sys.executable, "-m", "omni_jobs.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=full_env, check=False)


def test_submit_wait_shows_stage_progress_and_downloads_the_outputs(system: EmbeddedSystem, tmp_path: Path) -> None:
    run = omni(system, "submit", "text-to-image", "--prompt", "a paper boat on a pond",
               "--param", "dit.num_inference_steps=4", "--param", "dit.height=32", "--param", "dit.width=48",
               "--param", "dit.seed=5", "--param", "ar.max_tokens=8", "--wait", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr

    # stdout: one "name<TAB>path" line per output, nothing else.
    paths = dict(line.split("\t") for line in run.stdout.strip().splitlines())
    assert set(paths) == {"image", "text"}
    image_path, text_path = Path(paths["image"]), Path(paths["text"])
    job_id = image_path.parent.name
    assert job_id.startswith("job_") and image_path.parent == tmp_path / job_id
    assert image_path.name == "image.png" and text_path.name == "text.json"
    with Image.open(image_path) as image:
        assert (image.format, image.size) == ("PNG", (48, 32))
    assert json.loads(text_path.read_text())["text"]

    # stderr: a bar per stage, written as plain lines (no terminal here), ending in the status.
    err = run.stderr
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    assert lines[0].startswith(job_id)
    assert any(line.split()[0] == "ar" and "started on ar@" in line for line in lines)
    assert any(line.split()[0] == "dit" and "[########################] 4/4 steps" in line for line in lines)
    dit_done = next(i for i, line in enumerate(lines) if line.split()[0] == "dit" and " done in " in line)
    ar_done = next(i for i, line in enumerate(lines) if line.split()[0] == "ar" and " done in " in line)
    assert ar_done < dit_done
    assert f"{job_id} succeeded" in lines
    assert f"2 output(s) in {tmp_path / job_id}" in err

    # status, list and a refused cancel of the finished job.
    status = omni(system, "status", job_id)
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith(f"{job_id}  text-to-image  succeeded")
    assert "stage ar" in status.stdout and "stage dit" in status.stdout and "output image" in status.stdout
    as_json = json.loads(omni(system, "status", job_id, "--json").stdout)
    assert as_json["id"] == job_id and as_json["status"] == "succeeded"

    listed = omni(system, "list", "--limit", "50")
    assert listed.returncode == 0
    row = next(line for line in listed.stdout.splitlines() if line.startswith(job_id))
    assert row.split("\t")[1].strip() == "succeeded" and row.split("\t")[2] == "text-to-image"

    refused = omni(system, "cancel", job_id)
    assert refused.returncode == 1 and "already succeeded" in refused.stderr

    again = omni(system, "download", job_id, "--out", str(tmp_path / "again"))
    assert again.returncode == 0
    assert Path(dict(line.split("\t") for line in again.stdout.splitlines())["image"]).read_bytes() == \
        image_path.read_bytes()


def test_submit_without_wait_then_cancel(system: EmbeddedSystem, api: httpx.Client) -> None:
    submitted = omni(system, "submit", "text-to-image", "--prompt", "never finished", *SLOW)
    assert submitted.returncode == 0, submitted.stderr
    job_id, status = submitted.stdout.strip().split("\t")
    assert job_id.startswith("job_") and status == "queued"
    canceled = omni(system, "cancel", job_id)
    assert canceled.returncode == 0, canceled.stderr
    assert canceled.stdout.strip() == f"{job_id}\tcanceled"
    assert wait_for_job(api, job_id)["status"] == "canceled"


def test_errors_are_one_clear_line(system: EmbeddedSystem) -> None:
    missing = omni(system, "status", "job_nope")
    assert missing.returncode == 1 and missing.stderr.strip() == "no job 'job_nope'"
    bad = omni(system, "submit", "text-to-image", "--prompt", "x", "--param", "dit.height=50")
    assert bad.returncode == 3 and "body.params.dit.height" in bad.stderr and "Traceback" not in bad.stderr
    usage = omni(system, "submit", "text-to-image", "--prompt", "x", "--param", "height=50")
    assert usage.returncode == 2 and "STAGE.KEY=VALUE" in usage.stderr
    down = omni(system, "list", env={"OMNI_API_URL": "http://127.0.0.1:9"})
    assert down.returncode == 3 and "cannot reach the API at http://127.0.0.1:9" in down.stderr


def test_submit_uploads_a_local_image_given_as_at_file_or_as_an_existing_path(
        system: EmbeddedSystem, api: httpx.Client, tmp_path: Path) -> None:
    photo = tmp_path / "photo.png"
    Image.new("RGB", (40, 24), (200, 30, 30)).save(photo)
    for value in (f"@{photo}", str(photo)):
        run = omni(system, "submit", "image-to-image", "--prompt", "make it blue", "--input", f"image={value}",
                   "--param", "dit.num_inference_steps=2", "--param", "dit.height=32", "--param", "dit.width=32",
                   "--json")
        assert run.returncode == 0, run.stderr
        job = wait_for_job(api, json.loads(run.stdout)["id"])
        assert job["status"] == "succeeded", job["error"]
        stored = job["input"]["image"]
        assert (stored["width"], stored["height"], stored["media_type"]) == (40, 24, "image/png")
        assert stored["artifact"]["key"] == f"jobs/{job['id']}/inputs/image.png"


def test_submit_with_a_missing_file_fails_before_any_request(system: EmbeddedSystem, tmp_path: Path) -> None:
    missing = tmp_path / "nope.png"
    run = omni(system, "submit", "image-to-image", "--prompt", "x", "--input", f"image=@{missing}",
               env={"OMNI_API_URL": "http://127.0.0.1:9"})  # nothing listens there: no request is needed
    assert run.returncode == 2
    assert f"--input image=@{missing}: no such file" in run.stderr



def test_sourcing_the_systems_env_file_points_a_second_shell_at_it(
        system: EmbeddedSystem, api: httpx.Client, tmp_path: Path) -> None:
    """`. <home>/env` in a shell that knows nothing of the system (elsewhere, no OMNI_ settings of its
    own), as `omni-jobs up` tells its user: the doctor checks this system's Redis, store and workers,
    and a job goes to its API with its key."""
    shell_env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "OMNI_REDIS_URL": "redis://127.0.0.1:1/0"}

    def shell(command: str) -> str:
        run = subprocess.run(["bash", "-c", f". {system.cli_env_file} && {sys.executable} -m omni_jobs.cli {command}"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path, env=shell_env, check=False)
        assert run.returncode == 0, run.stdout + run.stderr
        return run.stdout

    report = json.loads(shell("doctor --no-devices --json"))
    checks = {(c["section"], c["name"]): c for c in report["checks"]}
    assert report["ok"]
    assert system.redis_url and system.redis_url.split("/")[2] in checks[("services", "redis")]["detail"]
    assert "s3" in checks[("services", "artifact store")]["detail"].lower()  # the system's S3, not a local dir
    assert all(checks[("workers", q)]["ok"] for q in ("ar", "dit", "results"))

    job_id, status = shell("submit text-to-text --prompt 'from another shell' --param ar.max_tokens=4").split()
    assert status == "queued"
    assert wait_for_job(api, job_id)["status"] == "succeeded"  # the demo tenant's job, seen with its key
