"""A thread's OpenMP team is handed back for real: torch's helper threads end, and come back with the
next parallel op (each case in a fresh interpreter, so no other test's threads are counted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, os, threading
import torch
from omni_jobs.engines.openmp import loaded_openmp_runtimes, release_thread_team

torch.set_num_threads(2)
counts = {}

def threads() -> int:
    return len(os.listdir("/proc/self/task"))

def engine_thread() -> None:
    counts["before"] = threads()
    torch.ones(4_000_000).mul_(2).sum()  # large enough to run on the whole team
    counts["with_team"] = threads()
    counts["released"] = release_thread_team()
    counts["after_release"] = threads()
    torch.ones(4_000_000).mul_(2).sum()
    counts["again"] = threads()

t = threading.Thread(target=engine_thread)
t.start(); t.join()
counts["runtimes"] = len(loaded_openmp_runtimes())
print(json.dumps(counts))
"""


def test_release_thread_team_ends_the_helper_threads_and_the_next_op_makes_a_team_again():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["runtimes"] >= 1 and counts["released"] == counts["runtimes"]
    assert counts["with_team"] > counts["before"]  # the parallel op made the thread a team
    assert counts["after_release"] == counts["before"]
    assert counts["again"] == counts["with_team"]


def test_without_torch_loaded_there_is_nothing_to_release():
    code = ("import sys; from omni_jobs.engines.openmp import release_thread_team; "
            "assert 'torch' not in sys.modules; print(release_thread_team())")
    # vLLM, once loaded by an earlier test, puts torch's libgomp in LD_PRELOAD for child processes
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, env=env)
    assert out.stdout.strip() == "0"
