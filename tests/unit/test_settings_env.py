"""List-valued settings from environment variables, as a new user writes them (issue 62): a comma-separated
list as well as a JSON one; a bad value stops the process with one line naming the variable and the format,
where it was a 40-line pydantic traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_jobs.core.settings import Settings, SettingsInvalid, load_settings

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("value", "expected"), [
    ("/dir", [Path("/dir")]),
    ("/a,/b", [Path("/a"), Path("/b")]),
    (" /a , /b ,", [Path("/a"), Path("/b")]),
    ('["/a", "/b"]', [Path("/a"), Path("/b")]),
    ("", []),
])
def test_pipelines_path_takes_one_path_a_comma_list_or_json(monkeypatch: pytest.MonkeyPatch, value: str,
                                                            expected: list[Path]) -> None:
    monkeypatch.setenv("OMNI_PIPELINES_PATH", value)
    assert Settings().pipelines_path == expected


@pytest.mark.parametrize(("value", "expected"), [
    ("127.0.0.1", ["127.0.0.1"]),
    ("127.0.0.1:9000,hooks.internal", ["127.0.0.1:9000", "hooks.internal"]),
    ('["127.0.0.1"]', ["127.0.0.1"]),
])
def test_webhook_allow_hosts_and_model_sources_take_comma_lists(monkeypatch: pytest.MonkeyPatch, value: str,
                                                                expected: list[str]) -> None:
    monkeypatch.setenv("OMNI_WEBHOOK_ALLOW_HOSTS", value)
    monkeypatch.setenv("OMNI_MODEL_SOURCES", value)
    settings = Settings()
    assert settings.webhook_allow_hosts == expected and settings.model_sources == expected


@pytest.mark.parametrize(("variable", "value", "says"), [
    ("OMNI_PIPELINES_PATH", '["/a", ', "a comma-separated list"),
    ("OMNI_WEBHOOK_ALLOW_HOSTS", '{"a": 1}', "a comma-separated list"),
    ("OMNI_WEBHOOK_ALLOW_HOSTS", "[1, 2]", "a comma-separated list"),
    ("OMNI_SUPPORTED_VERSIONS", "vllm>=0.11", "a JSON object"),
    ("OMNI_MAX_STEPS", "many", "integer"),
])
def test_a_bad_value_is_one_line_naming_the_variable_and_the_format(monkeypatch: pytest.MonkeyPatch, variable: str,
                                                                    value: str, says: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsInvalid) as caught:
        load_settings()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{variable}=") and says in message, message
    assert isinstance(caught.value, SystemExit)  # uncaught, the interpreter prints the line, no traceback


@pytest.mark.parametrize("command", [
    [sys.executable, "-c", "import api.main"],  # what uvicorn api.main:app imports
    [sys.executable, "-m", "omni_jobs.cli", "doctor", "--no-services", "--no-devices"],
])
def test_a_process_given_a_bad_list_exits_with_one_line(command: list[str]) -> None:
    env = {**os.environ, "OMNI_WEBHOOK_ALLOW_HOSTS": "[127.0.0.1", "OMNI_LOG_FORMAT": "text"}
    done = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("OMNI_WEBHOOK_ALLOW_HOSTS="), done.stderr
