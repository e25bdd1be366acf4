"""Workers neither gossip nor mingle: each one's cost would grow with the number of workers.

Celery's Gossip step subscribes every worker to every other worker's events (a heartbeat every 2
s each) and folds them into an in-memory cluster state; Mingle asks the other workers for their
revoked tasks and clocks at start. omni-jobs uses neither: liveness is its own registry
(omni_jobs.dispatch.worker_registry), a cancel is a ledger write, not a Celery revoke, and Flower reads the
events itself. With W workers, gossip has each one handle W/2 events a second in Python, in the
process whose engine thread needs the interpreter (with ~10 workers it was about as much CPU as
the outbox relay's passes).

This is ``--without-gossip --without-mingle`` for every launch of ``workers.app``, whatever its
command line (compose, Kubernetes, ``omni-jobs up``, a hand-typed one): Celery has no setting for
either (celery/celery#2566, open), but it has ``worker_consumer``, the consumer class a worker makes,
and that class receives the worker's options. workers.app names QuietConsumer there, and it hands
Celery's consumer the same two options the command-line flags set. Pinned by
tests/integration/test_quiet_cluster.py.
"""

from __future__ import annotations

from typing import Any

from celery.worker.consumer import Consumer

CONSUMER = f"{__name__}:QuietConsumer"
"""The value of the ``worker_consumer`` setting."""

QUIET = {"without_gossip": True, "without_mingle": True}
"""What ``--without-gossip --without-mingle`` put in a worker's options."""


class QuietConsumer(Consumer):
    """Celery's consumer, made as if the worker had been started with ``--without-gossip --without-mingle``."""

    def __init__(self, *args: Any, worker_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, worker_options={**(worker_options or {}), **QUIET}, **kwargs)
