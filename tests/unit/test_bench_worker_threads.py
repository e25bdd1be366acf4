"""bench.worker_threads' reading of a worker's threads: names from py-spy's dump, CPU from schedstat."""

from __future__ import annotations

import os
import threading
import time

from bench.procfs import thread_cpu_s
from bench.worker_threads import NATIVE, by_group, thread_names

DUMP = """Process 9572: /work/.venv/bin/python -m celery -A workers.app:app worker -Q dit
Python v3.11.7 (/root/.pyenv/versions/3.11.7/bin/python3.11)

Thread 9572 (idle): "MainThread"
    _epoll.poll (kombu/utils/eventio.py:83)
Thread 9789 (active+gil): "dit-dispatch"
    DiTEngine._call (omni_jobs/engines/dit.py:512)
Thread 9798 (idle): "ThreadPoolExecutor-0_26"
    Condition.wait (threading.py:327)
Thread 9799 (idle): "ThreadPoolExecutor-0_27"
    Condition.wait (threading.py:327)
"""


def test_names_come_from_each_thread_line_of_the_dump() -> None:
    assert thread_names(DUMP) == {9572: "MainThread", 9789: "dit-dispatch",
                                  9798: "ThreadPoolExecutor-0_26", 9799: "ThreadPoolExecutor-0_27"}
    assert thread_names("") == {}


def test_a_pools_threads_are_one_group_and_unnamed_threads_are_native() -> None:
    names = thread_names(DUMP)
    before = {9572: 1.0, 9789: 10.0, 9798: 0.5, 9799: 0.25, 4242: 3.0}
    after = {9572: 1.5, 9789: 14.0, 9798: 0.75, 9799: 0.5, 4242: 6.0, 4243: 0.125}  # 4243 started meanwhile
    assert by_group(before, after, names) == {
        "MainThread": (0.5, 1), "dit-dispatch": (4.0, 1), "ThreadPoolExecutor-0": (0.5, 2), NATIVE: (3.125, 2),
    }
    assert by_group({}, {7: 0.5}, {}) == {"thread 7": (0.5, 1)}  # no dump: listed by id


def test_schedstat_counts_a_threads_cpu_finer_than_a_tick() -> None:
    spent: list[int] = []

    def spin() -> None:
        spent.append(threading.get_native_id())
        end = time.thread_time() + 0.003  # 3 ms: under one 10 ms tick of /proc's stat
        while time.thread_time() < end:
            pass
        time.sleep(0.5)

    worker = threading.Thread(target=spin)
    worker.start()
    while not spent:
        time.sleep(0.001)
    time.sleep(0.1)
    cpu = thread_cpu_s(os.getpid())
    worker.join()
    assert 0.003 <= cpu[spent[0]] < 0.05
