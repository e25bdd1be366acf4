"""A launcher stopped with SIGTERM stops the services it started (devservices.exit_on_sigterm).

Each test runs a real launcher process that starts a real child service, then kills the launcher
as ``kill``/``pkill`` would, and looks for the child in the process table.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

LAUNCHER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from omni_jobs.local.devservices import RunningService, exit_on_sigterm
    if sys.argv[1] == "on":
        exit_on_sigterm()
    service = RunningService("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], 0, "-",
                             lambda: True, log_path=Path(sys.argv[2]), start_timeout_s=10)
    service.start()
    try:
        print(service.pid, flush=True)
        time.sleep(120)
    finally:
        print("finally ran", flush=True)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie has exited: only its parent has not reaped it yet
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def _launch(mode: str, tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, mode, str(tmp_path / "sleeper.log")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    assert _alive(child)
    return proc, child


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_runs_finally_and_stops_the_children(tmp_path: Path) -> None:
    proc, child = _launch("on", tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "finally ran" in out
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the service outlived its launcher"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_without_it_sigterm_orphans_the_children(tmp_path: Path) -> None:
    """Why the benchmarks call it: the default action ends the launcher and leaves its service."""
    proc, child = _launch("off", tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGTERM
        assert "finally ran" not in out
        time.sleep(0.5)
        assert _alive(child)
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_handler_already_set_is_kept() -> None:
    from omni_jobs.local.devservices import exit_on_sigterm

    previous = signal.getsignal(signal.SIGTERM)

    def mine(signum: int, frame: object) -> None:
        pass

    signal.signal(signal.SIGTERM, mine)
    try:
        exit_on_sigterm()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
