"""vLLM's process groups share one gloo device, so a process keeps one gloo loop thread, not one per group."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    from omni_jobs.engines.gloo_device import destroy_process_groups, one_gloo_device

    def loops():
        # A loop thread names itself once it runs, so one just made may still carry its parent's name:
        # the most seen within a second (no loop thread ends before destroy_process_groups).
        def named():
            return [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")].count("gloo_tcp_loop")
        most = 0
        for _ in range(50):
            most = max(most, named())
            time.sleep(0.02)
        return most

    def groups():  # as vLLM makes them: the world group, then a device and a CPU group per kind of parallelism
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        made = [dist.new_group([0], backend="gloo") for _ in range(4)]
        sums = []
        for g in made:
            t = torch.tensor([3.0])
            dist.all_reduce(t, group=g)
            sums.append(t.item())
        return sums

    if sys.argv[1] == "shared":
        with one_gloo_device():
            sums = groups()
    else:
        sums = groups()
    print(loops(), sums)
    destroy_process_groups()  # as a worker does at shutdown; without it, 3-6% of these processes aborted at exit under load
    print(dist.is_initialized())
""")


def _run(mode: str) -> str:
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_process_groups_made_within_the_block_share_one_loop_thread_and_still_work():
    assert _run("shared") == "1 [3.0, 3.0, 3.0, 3.0]\nFalse"
    assert _run("plain") == "5 [3.0, 3.0, 3.0, 3.0]\nFalse"  # torch's default: a device, so a loop thread, per group


def test_the_block_restores_torchs_own_constructor():
    torch_c10d = pytest.importorskip("torch.distributed.distributed_c10d")
    from omni_jobs.engines.gloo_device import one_gloo_device

    before = torch_c10d.ProcessGroupGloo
    with one_gloo_device():
        assert torch_c10d.ProcessGroupGloo is not before
    assert torch_c10d.ProcessGroupGloo is before

