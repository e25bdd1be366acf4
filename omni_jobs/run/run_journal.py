"""An append-only journal of engine runs, for audits and the chaos test (OMNI_RUN_JOURNAL).

Each line is JSON: when, which process, which step attempt, and what happened (the engine started;
its result was recorded). Written with O_APPEND in one write per line, so the lines of many worker
processes on one host interleave whole. Counting ``engine.start`` lines per (slot, attempt) shows
from outside the job store whether any attempt ran twice.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from omni_jobs.jobs.ledger import Lease


class RunJournal:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, lease: Lease, event: str) -> None:
        line = json.dumps({"at": time.time(), "pid": os.getpid(), "owner": lease.owner, "job_id": lease.job_id,
                           "slot": lease.slot, "attempt": lease.attempt, "event": event}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def read_journal(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
