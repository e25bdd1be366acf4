"""`omni-jobs up`'s home: the exports for a second shell, the claim on the home, and what is refused before any start."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from omni_jobs.core.settings import Settings
from omni_jobs.local.embedded import EmbeddedSystem, HomeInUse, RedisUnreachable


def a_started_system(tmp_path: Path) -> EmbeddedSystem:
    """What start() leaves set, without starting anything: a private Redis's URL and the demo key."""
    settings = Settings(models_dir=tmp_path / "models", artifacts_dir=tmp_path / "my artifacts")
    system = EmbeddedSystem(settings=settings, home=tmp_path / "home", api_port=18123,
                            extra_env={"OMNI_PIPELINES_PATH": json.dumps([str(tmp_path / "it's mine")])})
    system.home.mkdir(exist_ok=True)
    system.redis_url = "redis://127.0.0.1:41234/0"
    system.api_key = "ok_0123456789abcdef_secret-part"
    return system


def sourced(path: Path, names: list[str]) -> dict[str, str]:
    """The variables a shell has after `. path`, from a clean environment."""
    script = f". {path} && " + " && ".join(f'printf "%s\\0" "${name}"' for name in names)
    out = subprocess.run(["bash", "-c", script], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                         check=True).stdout.decode()
    return dict(zip(names, out.split("\0")[:-1], strict=True))


def test_a_second_shell_gets_this_systems_api_key_redis_and_artifacts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_REDIS_URL", "redis://elsewhere:6379/0")  # the user's shell pointed elsewhere
    system = a_started_system(tmp_path)
    path = system.write_cli_env()

    assert path == system.home / "env"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the key and the webhook secret
    got = sourced(path, ["OMNI_API_URL", "OMNI_API_KEY", "OMNI_REDIS_URL", "OMNI_ARTIFACTS_DIR",
                         "OMNI_PIPELINES_PATH", "OMNI_WEBHOOK_SECRET"])
    assert got["OMNI_API_URL"] == "http://127.0.0.1:18123"
    assert got["OMNI_API_KEY"] == "ok_0123456789abcdef_secret-part"
    assert got["OMNI_REDIS_URL"] == "redis://127.0.0.1:41234/0"  # this system's, not the shell's
    assert got["OMNI_ARTIFACTS_DIR"] == str((tmp_path / "my artifacts").resolve())  # a space, quoted
    assert json.loads(got["OMNI_PIPELINES_PATH"]) == [str(tmp_path / "it's mine")]  # a quote, quoted
    assert got["OMNI_WEBHOOK_SECRET"] == system.webhook_secret  # every OMNI_ setting the processes run with


def test_with_auth_off_there_is_no_key_to_export(tmp_path: Path) -> None:
    system = a_started_system(tmp_path)
    system.api_key = None
    assert "OMNI_API_KEY" not in system.cli_env()
    assert "OMNI_API_KEY" not in system.write_cli_env().read_text()


def test_stop_removes_it_since_its_ports_are_gone(tmp_path: Path) -> None:
    system = a_started_system(tmp_path)
    system.claim_home()
    path = system.write_cli_env()
    system.stop()
    assert not path.exists()


def test_a_second_system_in_the_same_home_is_refused_until_the_first_stops(tmp_path: Path) -> None:
    first, second = a_started_system(tmp_path), a_started_system(tmp_path)
    first.claim_home()
    env = first.write_cli_env()
    with pytest.raises(HomeInUse, match=rf"pid {os.getpid()}\) is running in {first.home}: .* another --home"):
        second.claim_home()
    second.stop()  # what `omni-jobs up` does after the refusal: the first's files stay
    assert env.exists()

    first.stop()
    second.claim_home()  # the home is free again
    second.stop()


def test_a_redis_url_that_does_not_answer_is_refused_with_the_fix(tmp_path: Path) -> None:
    """As after sourcing the env file of a system that has stopped: one line, nothing started."""
    system = a_started_system(tmp_path)
    system.redis_url = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    with pytest.raises(RedisUnreachable, match=r"cannot reach Redis at redis://127\.0\.0\.1:1/0 \(OMNI_REDIS_URL\): "
                                               r".*unset OMNI_REDIS_URL"):
        system.start(say=lambda _msg: None)
    assert system.processes == []
    system.stop()
