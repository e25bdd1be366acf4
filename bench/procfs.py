"""What the benchmarks read about a process from /proc (Linux): CPU time and memory."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads) so far, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int, field: str) -> float:
    """A memory line of /proc/PID/status in MiB: ``VmRSS`` (resident now), ``VmHWM`` (peak resident)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wakeups(pid: int) -> int:
    """Times the threads of a process (those alive now) went to sleep and were woken: the sum of their
    voluntary context switches. Each one is a wake-up of that process on the machine's cores."""
    return sum(thread_wakeups(pid).values())


def thread_wakeups(pid: int) -> dict[int, int]:
    """Each live thread's voluntary context switches so far (its sleeps, each ended by a wake-up), by id."""
    out: dict[int, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                out[int(task.name)] = int(line.split()[1])
    return out


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of a process so far, by thread id, from schedstat (nanoseconds: the
    ``stat`` file's 10 ms ticks are too coarse for a thread that runs ~0.05 ms a job)."""
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return out
