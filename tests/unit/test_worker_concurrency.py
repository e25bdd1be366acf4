"""The concurrency a worker registers (the scheduler's window counts it) is its WorkController's."""

from __future__ import annotations

from types import SimpleNamespace

from workers.tasks import worker_concurrency


def test_the_consumers_controller_concurrency_is_read():
    consumer = SimpleNamespace(controller=SimpleNamespace(concurrency=64), pool=SimpleNamespace(limit=64))
    assert worker_concurrency(consumer) == 64


def test_the_pool_limit_then_one_when_nothing_says():
    assert worker_concurrency(SimpleNamespace(controller=None, pool=SimpleNamespace(limit=8))) == 8
    assert worker_concurrency(SimpleNamespace()) == 1
