"""The engines' malloc (omni_jobs.engines.allocator): tcmalloc preloaded where installed, else glibc tuned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_jobs.engines import allocator
from omni_jobs.engines.allocator import MallocUnavailable, engine_process_env, find_tcmalloc, malloc_choice

REPO = Path(__file__).resolve().parents[2]

# A worker process (workers.app sets its malloc at import), then a DiT step's pattern in miniature:
# eight blocks of ~1 MiB allocated, written and freed, again and again. glibc as it comes gives the
# freed heap top back to the kernel each round, and the next round faults every page in again.
CHURN = """
import ctypes, json, resource, workers.app
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
block = (1 << 20) - (64 << 10)
one = libc.malloc(1 << 20); libc.free(one)  # glibc's own threshold moves up to 1 MiB here
def churn():
    blocks = [libc.malloc(block) for _ in range(8)]
    for b in blocks:
        ctypes.memset(b, 1, block)
    for b in reversed(blocks):
        libc.free(b)
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    churn()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"malloc": workers.app.ENGINE_MALLOC, "faults": faults}))
"""


def worker_churn(choice: str) -> dict[str, object]:
    """What a worker started as ``omni-jobs up`` starts it reports of its malloc, and its faults."""
    env = engine_process_env({**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
                              "OMNI_ENGINE_MALLOC": choice})
    out = subprocess.run([sys.executable, "-c", CHURN], cwd=REPO, env=dict(env), capture_output=True, text=True,
                         check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_tuned_glibc_keeps_freed_blocks_that_glibc_as_it_comes_gives_back() -> None:
    untouched, tuned = worker_churn("system"), worker_churn("glibc")
    assert untouched["malloc"] == "system malloc, untuned"
    assert tuned["malloc"] == "glibc, tuned"
    pages = 50 * 8 * ((1 << 20) - (64 << 10)) // 4096
    assert int(str(untouched["faults"])) > pages // 2  # every round faulted its blocks in again
    assert int(str(tuned["faults"])) < pages // 20


@pytest.mark.skipif(find_tcmalloc() is None, reason="no tcmalloc here (apt-get install libtcmalloc-minimal4)")
def test_where_tcmalloc_is_installed_a_worker_runs_on_it() -> None:
    seen = worker_churn("auto")
    assert seen["malloc"] == "tcmalloc"
    assert int(str(seen["faults"])) < 50 * 8 * 256 // 20


def test_auto_preloads_tcmalloc_before_what_the_user_preloads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    env = engine_process_env({"LD_PRELOAD": "/opt/mine.so"})
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4 /opt/mine.so"
    assert env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == str(1 << 40)  # no "large alloc" lines for weights
    assert engine_process_env(dict(env)) == env  # a second launcher adds nothing
    own = engine_process_env({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4", "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "9"})
    assert own["LD_PRELOAD"] == "/usr/lib/libtcmalloc.so.4"  # the user's own tcmalloc stays the one
    assert own["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "9"


def test_without_tcmalloc_auto_leaves_the_environment_and_tcmalloc_says_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert engine_process_env({"PATH": "/bin"}) == {"PATH": "/bin"}
    with pytest.raises(MallocUnavailable, match="apt-get install libtcmalloc-minimal4"):
        engine_process_env({"OMNI_ENGINE_MALLOC": "tcmalloc"})


@pytest.mark.parametrize("choice", ["glibc", "system"])
def test_glibc_and_system_preload_nothing(choice: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    assert engine_process_env({"OMNI_ENGINE_MALLOC": choice}) == {"OMNI_ENGINE_MALLOC": choice}


def test_a_bad_choice_names_the_good_ones() -> None:
    assert malloc_choice({"OMNI_ENGINE_MALLOC": "tcmalloc"}) == "tcmalloc"
    assert malloc_choice({}) == "auto"
    with pytest.raises(ValueError, match="OMNI_ENGINE_MALLOC must be one of auto, tcmalloc, glibc, system; got 'jemalloc'"):
        malloc_choice({"OMNI_ENGINE_MALLOC": "jemalloc"})
