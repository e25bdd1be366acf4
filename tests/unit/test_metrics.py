"""Prometheus metrics: values derived from real job events, artifact I/O, exposition, multiprocess mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from omni_jobs.artifacts import ArtifactStore, LocalBackend
from omni_jobs.jobs import state
from omni_jobs.jobs.models import Job, JobError, StageRecord
from omni_jobs.report import metrics

metrics.install()  # as the API and the workers do at start: the core reports to omni_jobs.core.telemetry

ROOT = Path(__file__).resolve().parents[2]


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def new_job(pipeline: str) -> Job:
    return Job(id="job_metrics" + pipeline.replace("-", ""), pipeline=pipeline, input={"prompt": "x"},
               stages=[StageRecord(id="ar", engine="ar", queue="ar"), StageRecord(id="dit", engine="dit", queue="dit")],
               created_at=100.0)


def test_a_succeeded_job_counts_statuses_queue_waits_and_stage_durations() -> None:
    pipeline = "metrics-ok"
    before_wait = sample("omni_jobs_stage_queue_wait_seconds_sum", pipeline=pipeline, stage="ar", queue="ar")
    job = new_job(pipeline)
    metrics.record_job_events(job, [*state.stage_queued(job, "ar", 100.0)])
    metrics.record_job_events(job, state.stage_started(job, "ar", "ar@h", 101.5))  # 1.5 s on the queue
    metrics.record_job_events(job, state.stage_succeeded(job, "ar", {}, {}, 102.0))  # 0.5 s running
    metrics.record_job_events(job, state.stage_queued(job, "dit", 102.0))
    metrics.record_job_events(job, state.stage_started(job, "dit", "dit@h", 102.25))
    metrics.record_job_events(job, state.stage_succeeded(job, "dit", {}, {}, 104.25))
    metrics.record_job_events(job, state.job_succeeded(job, 105.0))

    assert sample("omni_jobs_jobs_total", pipeline=pipeline, status="running") == 1
    assert sample("omni_jobs_jobs_total", pipeline=pipeline, status="succeeded") == 1
    assert sample("omni_jobs_job_duration_seconds_sum", pipeline=pipeline, status="succeeded") == pytest.approx(5.0)
    assert sample("omni_jobs_stage_queue_wait_seconds_sum", pipeline=pipeline, stage="ar", queue="ar") \
        - before_wait == pytest.approx(1.5)
    assert sample("omni_jobs_stage_duration_seconds_sum", pipeline=pipeline, stage="dit", engine="dit",
                  outcome="succeeded") == pytest.approx(2.0)
    # 2.0 s falls in the 2.5 s bucket, not the 1 s one.
    assert sample("omni_jobs_stage_duration_seconds_bucket", pipeline=pipeline, stage="dit", engine="dit",
                  outcome="succeeded", le="1.0") == 0
    assert sample("omni_jobs_stage_duration_seconds_bucket", pipeline=pipeline, stage="dit", engine="dit",
                  outcome="succeeded", le="2.5") == 1


def test_a_failed_job_counts_the_failed_stage_duration() -> None:
    pipeline = "metrics-fail"
    job = new_job(pipeline)
    state.stage_queued(job, "ar", 100.0)
    state.stage_started(job, "ar", "ar@h", 100.0)
    metrics.record_job_events(job, state.job_failed(job, JobError(stage="ar", type="StageError", message="x"), 103.0))
    assert sample("omni_jobs_jobs_total", pipeline=pipeline, status="failed") == 1
    assert sample("omni_jobs_stage_duration_seconds_sum", pipeline=pipeline, stage="ar", engine="ar",
                  outcome="failed") == pytest.approx(3.0)
    assert sample("omni_jobs_jobs_total", pipeline=pipeline, status="succeeded") == 0


def test_artifact_store_counts_bytes_by_backend_and_direction(tmp_path: Path) -> None:
    store = ArtifactStore(LocalBackend(tmp_path))
    put_before = sample("omni_jobs_artifact_bytes_total", backend="local", op="put")
    get_before = sample("omni_jobs_artifact_bytes_total", backend="local", op="get")
    ref = store.put_output("jobs/job_x/outputs/a.json", b"x" * 1234, "application/json")
    assert store.get(ref) == b"x" * 1234
    store.get(ref)
    assert sample("omni_jobs_artifact_bytes_total", backend="local", op="put") - put_before == 1234
    assert sample("omni_jobs_artifact_bytes_total", backend="local", op="get") - get_before == 2 * 1234


def test_process_memory_and_engine_memory_gauge() -> None:
    memory = metrics.record_engine_memory("metrics-mem", "dit", "dit")
    assert memory["cpu"] > 10 * 2**20  # a Python process with torch-free imports still holds > 10 MiB
    assert sample("omni_jobs_engine_memory_bytes", pipeline="metrics-mem", stage="dit", engine="dit",
                  device="cpu") == memory["cpu"]


def test_a_worker_labels_engine_memory_from_the_job_its_message_carried() -> None:
    """No read of the job after each stage: the snapshot names its pipeline and the stage's engine."""
    from types import SimpleNamespace

    from workers.observability import record_stage_memory

    class NoReads:
        def get(self, job_id: str) -> Job:
            raise AssertionError(f"read job {job_id} again")

    snapshot = new_job("metrics-snapshot")
    record_stage_memory(SimpleNamespace(ledger=NoReads()), snapshot.id, "dit", snapshot)  # type: ignore[arg-type]
    held = sample("omni_jobs_engine_memory_bytes", pipeline="metrics-snapshot", stage="dit", engine="dit", device="cpu")
    assert held > 10 * 2**20

    stored = new_job("metrics-read")  # a message without a snapshot (or another job's): the job is read
    reads: list[str] = []
    ledger = SimpleNamespace(get=lambda job_id: reads.append(job_id) or stored)
    record_stage_memory(SimpleNamespace(ledger=ledger), stored.id, "ar", snapshot)  # type: ignore[arg-type]
    assert reads == [stored.id]
    assert sample("omni_jobs_engine_memory_bytes", pipeline="metrics-read", stage="ar", engine="ar", device="cpu") > 0


def test_render_is_valid_exposition_with_extra_collectors() -> None:
    metrics.observe_batch("ar", 5)
    metrics.cache_lookup("engine", hit=False)
    metrics.webhook_delivery("completed", "delivered")

    class Fixed(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            family = GaugeMetricFamily("omni_jobs_queue_depth", "test", labels=["queue"])
            family.add_metric(["dit"], 3)
            yield family

    body, content_type = metrics.render(Fixed())
    assert content_type.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert {"omni_jobs_jobs", "omni_jobs_stage_duration_seconds", "omni_jobs_engine_batch_size",
            "omni_jobs_cache_requests", "omni_jobs_webhook_deliveries", "omni_jobs_queue_depth"} <= set(families)
    (depth,) = families["omni_jobs_queue_depth"].samples
    assert depth.labels == {"queue": "dit"} and depth.value == 3


def test_prefork_children_are_summed_in_multiprocess_mode(tmp_path: Path) -> None:
    """PROMETHEUS_MULTIPROC_DIR: two forked processes count; the parent's registry serves the sum."""
    script = textwrap.dedent("""
        import json, os
        from omni_jobs.report import metrics
        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families
        pids = []
        for n in (2, 3):
            pid = os.fork()
            if pid == 0:
                metrics.observe_batch("dit", n)
                metrics.cache_lookup("engine", hit=True)
                os._exit(0)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)
        text = generate_latest(metrics.process_registry()).decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
        print(json.dumps(out))
    """)
    env = {**os.environ, metrics.MULTIPROC_ENV: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    values = json.loads(proc.stdout.strip().splitlines()[-1])
    assert values['omni_jobs_engine_batch_size_count{"engine": "dit"}'] == 2
    assert values['omni_jobs_engine_batch_size_sum{"engine": "dit"}'] == 5
    assert values['omni_jobs_cache_requests_total{"cache": "engine", "result": "hit"}'] == 2


def test_a_stages_engine_memory_is_read_at_most_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's 32 jobs end at once: /proc is read for the first of them, not for each."""
    from types import SimpleNamespace

    from workers import observability

    read: list[tuple[str, str]] = []
    monkeypatch.setattr(observability.metrics, "record_engine_memory",
                        lambda pipeline, stage, engine: read.append((pipeline, stage)) or {})
    rt = SimpleNamespace(ledger=None)
    first, second = new_job("metrics-often"), new_job("metrics-often")
    for job in (first, second, first):
        observability.record_stage_memory(rt, job.id, "dit", job)  # type: ignore[arg-type]
    observability.record_stage_memory(rt, first.id, "ar", first)  # type: ignore[arg-type]
    assert read == [("metrics-often", "dit"), ("metrics-often", "ar")]
    real = time.monotonic
    monkeypatch.setattr(observability.time, "monotonic", lambda: real() + 1.5)
    observability.record_stage_memory(rt, second.id, "dit", second)  # type: ignore[arg-type]
    assert read[-1] == ("metrics-often", "dit") and len(read) == 3
