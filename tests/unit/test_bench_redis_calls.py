"""bench.redis_calls: the difference of two snapshots of Redis's counts, and its one-line summary."""

from __future__ import annotations

from collections import Counter

from bench.redis_calls import RedisCalls


def test_the_difference_counts_closed_clients_and_drops_unchanged_counts() -> None:
    before = RedisCalls(Counter({"evalsha": 10, "brpop": 4, "info": 1}), Counter({"api": 6, "dit": 9}), reads=20)
    after = RedisCalls(Counter({"evalsha": 74, "brpop": 68, "info": 1, "hget": 8}),
                       Counter({"api": 70, "dit": 60, "driver": 8}), reads=170)
    d = after - before
    assert d.by_command == Counter({"evalsha": 64, "brpop": 64, "hget": 8})
    # 136 commands ran, 123 by clients still open: the other 13 were a client's that closed meanwhile
    assert d.by_process == Counter({"api": 64, "dit": 51, "driver": 8, "closed": 13})
    assert d.reads == 150
    total = d + d
    assert total.reads == 300 and total.by_command["evalsha"] == 128
    line = d.per_job(64, top=2)
    assert line.startswith("2.3 round trips a job; 2.1 commands a job, by process: api 1.0, dit 0.8")
    assert line.endswith("by command: evalsha 1.0, brpop 1.0")


def test_without_per_client_counts_only_commands_are_given() -> None:
    d = RedisCalls(Counter({"evalsha": 5}), Counter(), reads=7) - RedisCalls(Counter(), Counter(), reads=2)
    assert d.by_process == Counter() and d.per_job(5) == "1.0 round trips a job; 1.0 commands a job; by command: evalsha 1.0"
