"""Redis's work per job: round trips, and commands by process and by command.

Each round trip another process makes to Redis wakes Redis and that process on the engines' cores,
and on two cores each such wake-up costs a running batch about 1 ms (bench.wakeups). This counts,
from Redis itself, around a stretch of work:

- round trips: Redis's read events (``total_reads_processed``: one per client request it woke for,
  a pipeline's commands often in one);
- commands by name, from ``INFO commandstats``; the commands a script calls count too, so this is
  Redis's work, not the clients' round trips;
- commands by process, from ``CLIENT LIST``'s ``tot-cmds`` (valkey 8 and Redis 8, absent from
  Redis 7; a script's calls count for the client that ran it), each client's port matched to its
  process by ``ss``. A client that closed within the stretch is counted under ``closed``.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_SS_PID = re.compile(r"pid=(\d+)")


@dataclass
class RedisCalls:
    """Commands Redis ran, by command name and by client process name."""

    by_command: Counter[str] = field(default_factory=Counter)
    by_process: Counter[str] = field(default_factory=Counter)
    reads: int = 0
    usec: Counter[str] = field(default_factory=Counter)
    """Redis's time in each command (a script's includes the commands it calls, which count again
    under their own names)."""

    def __sub__(self, before: RedisCalls) -> RedisCalls:
        commands = Counter({k: v - before.by_command.get(k, 0) for k, v in self.by_command.items()})
        processes = Counter({k: v - before.by_process.get(k, 0) for k, v in self.by_process.items()})
        closed = sum(commands.values()) - sum(processes.values())
        if self.by_process and closed > 0:
            processes["closed"] = closed
        usec = Counter({k: v - before.usec.get(k, 0) for k, v in self.usec.items()})
        return RedisCalls(+commands, +processes, self.reads - before.reads, +usec)

    def __add__(self, other: RedisCalls) -> RedisCalls:
        return RedisCalls(self.by_command + other.by_command, self.by_process + other.by_process,
                          self.reads + other.reads, self.usec + other.usec)

    def per_job(self, jobs: int, top: int = 8) -> str:
        """One line: round trips a job, commands a job in all, by process, then the ``top`` commands."""
        total = sum(self.by_command.values())

        def part(counts: Counter[str], n: int | None) -> str:
            return ", ".join(f"{k} {v / jobs:.1f}" for k, v in counts.most_common(n))

        text = f"{self.reads / jobs:.1f} round trips a job; {total / jobs:.1f} commands a job"
        if self.by_process:
            text += f", by process: {part(self.by_process, None)}"
        text += f"; by command: {part(self.by_command, top)}"
        if self.usec:
            text += f"; us a job (a script's include its calls): {part(self.usec, top)}"
        return text


def snapshot(client: Any, names: Mapping[int, str]) -> RedisCalls:
    """Redis's command counts now. ``names`` maps a process id to the name to count its clients
    under (the others count as ``other``); ``client`` is a ``redis.Redis``, whose INFO and CLIENT LIST
    count too (three commands a snapshot)."""
    reads = int(client.info("stats")["total_reads_processed"])
    stats = client.info("commandstats")
    commands = Counter({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()})
    usec = Counter({k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in stats.items()})
    listing = client.client_list()
    processes: Counter[str] = Counter()
    if listing and "tot-cmds" in listing[0]:
        owners = _port_owners(int(listing[0]["laddr"].rsplit(":", 1)[1]))
        for c in listing:
            port = int(c["addr"].rsplit(":", 1)[1])
            processes[names.get(owners.get(port, -1), "other")] += int(c["tot-cmds"])
    return RedisCalls(commands, processes, reads, usec)


def _port_owners(redis_port: int) -> dict[int, int]:
    """Local port -> process id of every TCP connection to ``redis_port`` on this machine."""
    out = subprocess.run(["ss", "-tnpH", "dst", f"127.0.0.1:{redis_port}"], capture_output=True, text=True,
                         check=False).stdout
    owners = {}
    for line in out.splitlines():
        cols = line.split()
        if len(cols) < 6 or (m := _SS_PID.search(line)) is None:
            continue
        owners[int(cols[3].rsplit(":", 1)[1])] = int(m.group(1))
    return owners
