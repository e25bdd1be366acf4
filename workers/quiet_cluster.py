"""Workers neither gossip nor mingle: each one's cost would grow with the number of workers.

Celery's Gossip step subscribes every worker to every other worker's events (a heartbeat every 2
s each) and folds them into an in-memory cluster state; Mingle asks the other workers for their
revoked tasks and clocks at start. omni-jobs uses neither: liveness is its own registry
(omni_jobs.worker_registry), a cancel is a ledger write, not a Celery revoke, and Flower reads the
events itself. With W workers, gossip has each one handle W/2 events a second in Python, in the
process whose engine thread needs the interpreter (with ~10 workers it was about as much CPU as
the outbox relay's passes). This is ``--without-gossip --without-mingle`` for every launch of
``workers.app``, whatever its command line: compose, Kubernetes, ``omni-jobs up``, a hand-typed one.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, bootsteps
from celery.worker.consumer.gossip import Gossip
from celery.worker.consumer.mingle import Mingle


class QuietCluster(bootsteps.StartStopStep):
    """A consumer step made after Gossip (which comes after Mingle) that turns both off before they start."""

    requires = (Gossip,)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        for name in (Gossip.name, Mingle.name):
            step = parent.blueprint.steps.get(name)
            if step is not None:
                step.enabled = False
        super().__init__(parent, **kwargs)

    def include_if(self, parent: Any) -> bool:
        return False  # nothing to start of its own


def install(app: Celery) -> None:
    app.steps["consumer"].add(QuietCluster)
