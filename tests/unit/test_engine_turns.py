"""Engines of one host take turns (omni_jobs.engines.turns): checked with real processes holding the
host's lock file, as two worker processes would, and one killed while it holds the turn."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from omni_jobs.engines import turns
from omni_jobs.engines.turns import EngineTurns, lock_file

STEPPER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from omni_jobs.engines.turns import EngineTurns
    turns, name, steps, out = EngineTurns(Path(sys.argv[1])), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    while not (out.parent / "go").exists():  # both engines start together
        time.sleep(0.002)
    spans = []
    with turns.turn():                      # one long engine call ...
        for _ in range(steps):
            started = time.monotonic()
            time.sleep(0.01)                # ... a step of it, with every core
            spans.append((started, time.monotonic()))
            turns.pass_turn()               # ... then another engine's step
    out.write_text("\\n".join(f"{name} {a} {b}" for a, b in spans))
""")


def _run_steppers(lock: Path, tmp: Path, names: list[str], steps: int) -> list[tuple[float, float, str]]:
    procs = [subprocess.Popen([sys.executable, "-c", STEPPER, str(lock), n, str(steps), str(tmp / f"{n}.txt")])
             for n in names]
    time.sleep(1.0)  # both started and waiting
    (tmp / "go").touch()
    for p in procs:
        assert p.wait(timeout=60) == 0
    spans = []
    for n in names:
        for line in (tmp / f"{n}.txt").read_text().splitlines():
            who, a, b = line.split()
            spans.append((float(a), float(b), who))
    return sorted(spans)


def test_two_engine_processes_never_step_at_once_and_take_turns(tmp_path: Path) -> None:
    spans = _run_steppers(tmp_path / "turns", tmp_path, ["ar", "dit"], steps=20)
    assert len(spans) == 40
    for (_a0, end, _w0), (start, _b1, _w1) in itertools.pairwise(spans):
        assert start >= end  # one step at a time on the host
    owners = [who for _a, _b, who in spans]
    switches = sum(1 for x, y in itertools.pairwise(owners) if x != y)
    # both stepping, they alternate (the gate): not one engine's 20 steps, then the other's
    assert switches >= 30, owners


def test_a_holder_killed_mid_step_gives_the_turn_back(tmp_path: Path) -> None:
    lock = tmp_path / "turns"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from omni_jobs.engines.turns import EngineTurns
        with EngineTurns(Path({str(lock)!r})).turn():
            print("holding", flush=True)
            time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    mine = EngineTurns(lock)
    taken = threading.Event()

    def take() -> None:
        with mine.turn():
            taken.set()

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    assert not taken.wait(0.3)  # the other process holds it
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert taken.wait(5)  # the kernel dropped the dead holder's lock
    mine.close()


def test_threads_of_one_process_take_turns_too_and_a_turn_nests(tmp_path: Path) -> None:
    shared = EngineTurns(tmp_path / "turns")
    inside = 0
    most = 0
    guard = threading.Lock()

    def engine() -> None:
        nonlocal inside, most
        for _ in range(10):
            with shared.turn(), shared.turn():  # nested: an engine call that holds it already
                with guard:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0.002)
                with guard:
                    inside -= 1
                shared.pass_turn()

    threads = [threading.Thread(target=engine) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert most == 1 and not shared.held()
    shared.close()


def test_the_setting_names_the_lock_file() -> None:
    assert lock_file("off", "cpu") is None
    assert lock_file("auto", "cpu") == turns.DEFAULT_FILE
    assert lock_file("auto", "cuda:0") is None  # a GPU engine does not share the host's cores
    assert lock_file("/shared/turns", "cuda") == Path("/shared/turns")


def test_unconfigured_engines_do_not_take_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turns, "_turns", None)
    with turns.engine_turn():
        turns.pass_turn()
    assert not turns.taking_turns()
    turns.configure(tmp_path / "turns")
    try:
        assert turns.taking_turns()
        with turns.engine_turn():
            assert turns._turns is not None and turns._turns.held()
    finally:
        turns.configure(None)
    assert not turns.taking_turns()


def test_a_lock_file_that_cannot_be_opened_leaves_turns_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("")
    turns.configure(tmp_path / "file" / "turns")  # a path under a file: cannot be made
    assert not turns.taking_turns()
    assert "OMNI_ENGINE_TURNS" in caplog.text
