"""The hard time limit ends a process stuck in a call that never returns, after recording why."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from omni_jobs.run.watchdog import EXIT_CODE, Deadlines, hard_time_limit
from tests.waiting import wait_until


def test_stuck_call_is_recorded_then_the_process_exits(tmp_path: Path) -> None:
    marker = tmp_path / "why.txt"
    script = textwrap.dedent(f"""
        import time
        from omni_jobs.run.watchdog import hard_time_limit
        with hard_time_limit(0.3, lambda: open({str(marker)!r}, "w").write("hard limit")):
            time.sleep(30)  # a call that never comes back in time
        print("not reached")
    """)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20, check=False,
                          cwd=Path(__file__).resolve().parents[2])
    elapsed = time.monotonic() - started
    assert proc.returncode == EXIT_CODE, proc.stderr
    assert "not reached" not in proc.stdout
    assert marker.read_text() == "hard limit"
    assert elapsed < 10


def test_body_that_finishes_in_time_is_untouched() -> None:
    fired: list[bool] = []
    with hard_time_limit(0.5, lambda: fired.append(True), exit_process=False):
        time.sleep(0.01)
    time.sleep(1.0)  # well past the limit: a limit left armed would have fired by now
    assert fired == []


def test_one_thread_runs_each_due_call_in_order_and_none_that_was_cancelled() -> None:
    deadlines = Deadlines()
    ran: list[str] = []
    started = time.monotonic()  # the delays leave a busy machine hundreds of ms to add and cancel them all
    late = deadlines.add(1.2, lambda: ran.append("late"))
    deadlines.add(1.0, lambda: ran.append("second"))
    deadlines.add(0.3, lambda: ran.append("first"))  # due before what the thread already waits for
    cancelled = [deadlines.add(0.6, lambda: ran.append("cancelled")) for _ in range(200)]
    for token in cancelled:
        deadlines.cancel(token)
    deadlines.cancel(late)
    wait_until(lambda: len(ran) >= 2, what="the two calls left")
    time.sleep(max(0.0, started + 1.5 - time.monotonic()))  # past the cancelled ones' time too
    assert ran == ["first", "second"]
    assert len(deadlines._heap) == 0  # the cancelled ones were swept or skipped, not kept
