"""`omni-jobs up --engine-workers 2`: two DiT workers on one queue, each on its own CPUs, share the jobs.

A system of its own (the session system runs one worker per queue): Redis DB 11, the API, two DiT
workers and the results worker, real processes. What a client sees: every job succeeds, and both
workers ran some, each taking turns only with the engines on its own CPUs (OMNI_ENGINE_CPUS).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.worker_registry import workers as registered_workers
from omni_jobs.engines import turns
from omni_jobs.engines.cpu_layout import engine_slice, host_cpus
from omni_jobs.local.devservices import RunningService, free_port
from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.conftest import DIT_ONLY_PIPELINE, auth_headers, models_dir
from tests.e2e.helpers import submit, wait_for_job

ENGINE_WORKERS_DB = 11  # apart from 0 (flushed by other tests), 3 (e2e), 5 (ui), 6-10 (integration, fuzz)


@pytest.fixture(scope="module")
def two_dit_workers(tmp_path_factory: pytest.TempPathFactory, redis_service: RunningService) -> Iterator[EmbeddedSystem]:
    home = tmp_path_factory.mktemp("engine-workers")
    pipelines = home / "pipelines"
    pipelines.mkdir()
    (pipelines / "dit-only.yaml").write_text(yaml.safe_dump(DIT_ONLY_PIPELINE))
    redis_url = f"redis://127.0.0.1:{redis_service.port}/{ENGINE_WORKERS_DB}"
    redis.Redis.from_url(redis_url).flushdb()
    system = EmbeddedSystem(
        settings=Settings(models_dir=models_dir(), artifacts_dir=home / "artifacts", redis_url=redis_url),
        home=home, api_port=free_port(), redis_url=redis_url, with_flower=False, engine_workers=2,
        worker_queues={"dit": "threads", "results": "solo"},
        extra_env={"OMNI_PIPELINES_PATH": json.dumps([str(pipelines)]), "OMNI_STAGE_MAX_IN_FLIGHT": "2"},
    )
    try:
        system.start(say=lambda _msg: None)
        yield system
    finally:
        system.stop()


def _turn_files(pid: int) -> set[str]:
    """The engine-turn lock files a worker holds open (its engines take turns through them)."""
    fds = Path(f"/proc/{pid}/fd")
    names = set()
    for fd in fds.iterdir():
        try:
            target = Path(fd.readlink())
        except OSError:  # closed meanwhile
            continue
        if target.name.startswith(turns.DEFAULT_FILE.name) and not target.name.endswith(".gate"):
            names.add(target.name)
    return names


def test_two_engine_workers_on_their_own_cpus_share_a_burst_of_jobs(two_dit_workers: EmbeddedSystem) -> None:
    system = two_dit_workers
    workers = {p.name: p.pid for p in system.processes if p.name.startswith("worker-dit") and p.pid}
    assert sorted(workers) == ["worker-dit", "worker-dit-2"]

    with httpx.Client(base_url=system.api_url, timeout=30, headers=auth_headers(system.api_key)) as api:
        ids = [submit(api, "dit-only", f"a lighthouse, number {i}")["id"] for i in range(12)]
        jobs = [wait_for_job(api, job_id, timeout_s=240) for job_id in ids]
        assert [j["status"] for j in jobs] == ["succeeded"] * 12, [j.get("error") for j in jobs]
        nodes = {j["stages"][0]["worker"].split("@")[0] for j in jobs}
        assert nodes == {"dit", "dit-2"}  # 12 jobs, 2 in flight per worker: both took some
        image = api.get(jobs[0]["outputs"][0]["url"])
        assert image.status_code == 200 and image.content.startswith(b"\x89PNG")

    # each took turns only with the engines on its own CPUs ("0" and "1" on 2 cores), not the host's shared
    # turn, and says its CPUs in its heartbeat (what `omni-jobs doctor` shows)
    assert system.redis_url
    client = redis.Redis.from_url(system.redis_url)
    heartbeats = {w.name.split("@")[0]: w.cpus for w in registered_workers(client)}
    client.close()
    for index, node in enumerate(["dit", "dit-2"]):
        spec = engine_slice(index, 2, host_cpus())
        assert _turn_files(workers[f"worker-{node}"]) == {f"{turns.DEFAULT_FILE.name}.cpus-{spec}"}, node
        assert heartbeats[node] == spec
