"""Two small processes for the lease tests: a worker holding a running step's lease (renewed by its
LeaseKeeper, with a reaper of its own, as every worker runs one), and a worker that only reaps.

    python -m tests.fault.lease_actors hold REDIS_URL JOB_ID LEASE_S   # prints "held", then "lost" if it is
    python -m tests.fault.lease_actors reap REDIS_URL LEASE_S
"""

from __future__ import annotations

import sys
import threading
import time

import redis

from omni_jobs.jobs.ledger import Acquired, JobLedger
from omni_jobs.jobs.store import RedisJobStore
from omni_jobs.leases import LeaseKeeper, Reaper, lease_owner
from omni_jobs.steps import RunStage


def reaper(ledger: JobLedger, store: RedisJobStore, name: str, lease_s: float) -> Reaper:
    """A worker's reaper (its grace after an outage: the ledger's lease), passing more often than the lease."""
    return Reaper(ledger, store, owner=lease_owner(name), queues=list, interval_s=min(2.0, lease_s / 6))


def main(argv: list[str]) -> int:
    action, url = argv[0], argv[1]
    lease_s = float(argv[-1])
    store = RedisJobStore(redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2), ttl_s=3600)
    ledger = JobLedger(store, lease_s=lease_s)
    if action == "hold":
        taken = ledger.acquire(RunStage(argv[2], "s", 1, "s"), worker="holder@test", owner=lease_owner("holder@test"))
        assert isinstance(taken, Acquired), taken
        lost = threading.Event()
        keeper = LeaseKeeper(ledger, every_s=lease_s / 3)
        reaper(ledger, store, "holder@test", lease_s).start()
        with keeper.hold(taken.lease, lost.set):
            print("held", flush=True)
            lost.wait()
        print("lost", flush=True)
        return 3
    reaper(ledger, store, "reaper@test", lease_s).start()
    print("reaping", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
