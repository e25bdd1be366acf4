"""How many messages wait in each Celery queue, read straight from the Redis broker.

Used to refuse work the system cannot do (overload -> 503 with Retry-After) and for metrics. It
counts messages not yet taken by a worker; what workers hold (unacked) is not waiting.
"""

from __future__ import annotations

import redis

from omni_jobs.core import keys


def queue_depth(broker: redis.Redis, queue: str) -> int:
    with broker.pipeline(transaction=False) as pipe:
        for name in keys.broker_queue_lists(queue):
            pipe.llen(name)
        return sum(int(n) for n in pipe.execute())


def queue_depths(broker: redis.Redis, queues: set[str]) -> dict[str, int]:
    return {q: queue_depth(broker, q) for q in sorted(queues)}
