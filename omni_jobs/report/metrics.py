"""Prometheus metrics of every omni-jobs process: one list of names, labels and helpers.

Each process (the API, each worker) counts what it sees itself and serves it: the API on
``GET /metrics``, a worker on ``OMNI_METRICS_PORT``. Prometheus sums across targets, so a counter
such as ``omni_jobs_jobs_total`` is complete once every process is scraped. Values that live in
Redis (queue depth, live workers) are read at scrape time by the API only, so they are never
counted twice.

The core reports what it does to ``omni_jobs.core.telemetry`` and imports nothing from here; the API
and the workers call ``install()`` at start, which makes this module a telemetry listener. Job and
stage metrics come from the job ledger's commit listener (``record_job_events``, through
``omni_jobs.jobs.commit_listeners``): every status change of every job passes through it in whichever process made the
change, so no shell has to remember to count. Prefork workers (several processes behind one port) need
``PROMETHEUS_MULTIPROC_DIR`` set to an empty directory before start; then each child writes its
values there and the port serves their sum (prometheus-client's multiprocess mode).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omni_jobs.core import telemetry
from omni_jobs.jobs import commit_listeners
from omni_jobs.report import usage

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    import redis

    from omni_jobs.jobs.models import Job, JobEvent

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Seconds: from a 10 ms tiny-model stage to a half-hour video stage.
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# --- jobs and stages (from job events) ---
JOBS = Counter(
    "omni_jobs_jobs_total", "Jobs that entered a status (queued, running, succeeded, failed, canceled).",
    ["pipeline", "status"],
)
JOB_DURATION = Histogram(
    "omni_jobs_job_duration_seconds", "Time from submission to the end of a job, by final status.",
    ["pipeline", "status"], buckets=DURATION_BUCKETS,
)
STAGE_DURATION = Histogram(
    "omni_jobs_stage_duration_seconds", "Time a stage ran on its worker (started to finished), by outcome.",
    ["pipeline", "stage", "engine", "outcome"], buckets=DURATION_BUCKETS,
)
STAGE_QUEUE_WAIT = Histogram(
    "omni_jobs_stage_queue_wait_seconds", "Time a stage waited on its queue before a worker started it.",
    ["pipeline", "stage", "queue"], buckets=DURATION_BUCKETS,
)

# --- engines (worker processes) ---
BATCH_SIZE = Histogram(
    "omni_jobs_engine_batch_size", "Requests per engine call (one vLLM generate, one diffusers pipeline call).",
    ["engine"], buckets=BATCH_BUCKETS,
)
BATCH_WAIT = Histogram(
    "omni_jobs_engine_batch_wait_seconds", "Time the first request of a batch waited for the batch to start: the "
    "batcher's window, its fill wait, and the engine's previous batch.", ["engine"], buckets=DURATION_BUCKETS,
)
BATCH_RUN = Histogram(
    "omni_jobs_engine_batch_run_seconds", "Time a batch ran on its engine (for AR, until the last request that "
    "joined it finished).", ["engine"], buckets=DURATION_BUCKETS,
)
CACHE_REQUESTS = Counter(
    "omni_jobs_cache_requests_total", "Cache lookups by cache and result (hit or miss); 'engine' is the per-process "
    "engine pool (a miss loads a model), 'stage' the stage-output cache.", ["cache", "result"],
)
ENGINE_LOAD = Histogram(
    "omni_jobs_engine_load_seconds", "Time to load an engine (a cache miss).", ["engine"], buckets=DURATION_BUCKETS,
)
ENGINE_RESTARTS = Counter(
    "omni_jobs_engine_restarts_total", "Engine processes that crashed and were started again by their worker "
    "(the call they ran was sent again).", ["engine"],
)
ENGINE_MEMORY = Gauge(
    "omni_jobs_engine_memory_bytes", "Memory held by the worker that ran the stage, after it ran: resident memory "
    "(device='cpu') and, where CUDA is in use, the bytes torch has reserved on the GPU (device='cuda:N').",
    ["pipeline", "stage", "engine", "device"], multiprocess_mode="liveall",
)

# --- artifacts, webhooks, HTTP ---
ARTIFACT_BYTES = Counter(
    "omni_jobs_artifact_bytes_total", "Artifact bytes written (op='put') and read (op='get'), by backend.",
    ["backend", "op"],
)
ARTIFACT_OPS = Counter(
    "omni_jobs_artifact_operations_total", "Artifact puts and gets, by backend.", ["backend", "op"],
)
WEBHOOK_DELIVERIES = Counter(
    "omni_jobs_webhook_deliveries_total", "Webhook delivery attempts by event and outcome "
    "(delivered, retrying, failed, skipped).", ["event", "outcome"],
)
QUOTA_REFUSALS = Counter(
    "omni_jobs_quota_refusals_total", "Submissions refused (429) because the tenant reached a quota, by limit.",
    ["limit"],
)
HTTP_REQUESTS = Counter(
    "omni_jobs_http_requests_total", "API requests by method, route template and status code.",
    ["method", "route", "status"],
)
HTTP_DURATION = Histogram(
    "omni_jobs_http_request_duration_seconds", "API request latency by method and route template.",
    ["method", "route"], buckets=DURATION_BUCKETS,
)

# --- usage per tenant (omni_jobs.report.usage: the same increments GET /v1/usage reads from Redis) ---
TENANT_JOBS = Counter("omni_jobs_tenant_jobs_total", "Jobs per tenant by status (queued: every job made).",
                      ["tenant", "status"])
TENANT_STAGE_SECONDS = Counter("omni_jobs_tenant_stage_seconds_total", "Stage run time per tenant and queue.",
                               ["tenant", "queue"])
TENANT_TOKENS = Counter("omni_jobs_tenant_tokens_total", "AR tokens per tenant, in (prompt) and out (completion).",
                        ["tenant", "direction"])
TENANT_IMAGES = Counter("omni_jobs_tenant_images_total", "Images output by succeeded jobs, per tenant.", ["tenant"])
TENANT_AUDIO_SECONDS = Counter("omni_jobs_tenant_audio_seconds_total", "Seconds of audio output, per tenant.",
                               ["tenant"])
TENANT_VIDEO_FRAMES = Counter("omni_jobs_tenant_video_frames_total", "Video frames output, per tenant.", ["tenant"])

_FINAL = {"job.succeeded": "succeeded", "job.failed": "failed", "job.canceled": "canceled"}


# --- recording helpers (each one cheap, none raises into the caller) ---
def record_job_events(job: Job, events: list[JobEvent]) -> None:
    """Ledger listener: count status changes and observe stage timings from the committed events."""
    for event in events:
        kind = event.type
        if kind == "job.queued" or kind == "job.running":
            JOBS.labels(job.pipeline, kind.split(".", 1)[1]).inc()
        elif kind in _FINAL:
            status = _FINAL[kind]
            JOBS.labels(job.pipeline, status).inc()
            JOB_DURATION.labels(job.pipeline, status).observe(max(0.0, event.at - job.created_at))
            if kind == "job.failed":
                _observe_failed_stage(job, event)
        elif kind == "stage.started":
            record = job.stage_record(str(event.data["stage"]))
            if record.queued_at is not None:
                STAGE_QUEUE_WAIT.labels(job.pipeline, record.id, record.queue).observe(
                    max(0.0, event.at - record.queued_at))
        elif kind == "stage.succeeded":
            record = job.stage_record(str(event.data["stage"]))
            if record.duration_s is not None:
                STAGE_DURATION.labels(job.pipeline, record.id, record.engine, "succeeded").observe(record.duration_s)


def record_usage(job: Job, events: list[JobEvent]) -> None:
    """The tenant counters: what omni_jobs.report.usage says a commit adds."""
    for inc in usage.increments(job, events):
        field, _, detail = inc.field.partition(":")
        if field == "jobs":
            TENANT_JOBS.labels(inc.tenant, detail).inc(inc.amount)
        elif field == "stage_seconds":
            TENANT_STAGE_SECONDS.labels(inc.tenant, detail).inc(inc.amount)
        elif field in ("tokens_in", "tokens_out"):
            TENANT_TOKENS.labels(inc.tenant, "input" if field == "tokens_in" else "output").inc(inc.amount)
        elif field == "images":
            TENANT_IMAGES.labels(inc.tenant).inc(inc.amount)
        elif field == "audio_seconds":
            TENANT_AUDIO_SECONDS.labels(inc.tenant).inc(inc.amount)
        elif field == "video_frames":
            TENANT_VIDEO_FRAMES.labels(inc.tenant).inc(inc.amount)


def _observe_failed_stage(job: Job, event: JobEvent) -> None:
    error = event.data.get("error")
    stage_id = error.get("stage") if isinstance(error, dict) else None
    if not isinstance(stage_id, str) or not stage_id:
        return
    try:
        record = job.stage_record(stage_id)
    except KeyError:
        return
    if record.started_at is not None:
        STAGE_DURATION.labels(job.pipeline, record.id, record.engine, "failed").observe(
            max(0.0, event.at - record.started_at))


def observe_batch(engine: str, size: int) -> None:
    """One engine call with ``size`` requests."""
    BATCH_SIZE.labels(engine).observe(size)


def observe_batch_ran(engine: str, waited_s: float, run_s: float) -> None:
    """One batcher batch: how long its first request waited for it, and how long it ran."""
    BATCH_WAIT.labels(engine).observe(waited_s)
    BATCH_RUN.labels(engine).observe(run_s)


def cache_lookup(cache: str, hit: bool) -> None:
    """One lookup in a named cache: ``engine`` (the engine pool) or ``stage`` (the stage-output cache)."""
    CACHE_REQUESTS.labels(cache, "hit" if hit else "miss").inc()


def observe_engine_load(engine: str, seconds: float) -> None:
    ENGINE_LOAD.labels(engine).observe(seconds)


def artifact_io(backend: str, op: str, size: int) -> None:
    """Bytes moved to (put) or from (get) an artifact backend."""
    ARTIFACT_BYTES.labels(backend, op).inc(size)
    ARTIFACT_OPS.labels(backend, op).inc()


def webhook_delivery(event: str, outcome: str) -> None:
    WEBHOOK_DELIVERIES.labels(event, outcome).inc()


class PrometheusListener(telemetry.Listener):
    """The core's telemetry as Prometheus metrics (names and labels as above)."""

    def batch(self, engine: str, size: int) -> None:
        observe_batch(engine, size)

    def batch_ran(self, batcher: str, waited_s: float, run_s: float) -> None:
        observe_batch_ran(batcher, waited_s, run_s)

    def cache_lookup(self, cache: str, hit: bool) -> None:
        cache_lookup(cache, hit)

    def engine_load(self, engine: str, seconds: float) -> None:
        observe_engine_load(engine, seconds)

    def engine_restart(self, engine: str) -> None:
        ENGINE_RESTARTS.labels(engine).inc()

    def artifact_io(self, backend: str, op: str, size: int) -> None:
        artifact_io(backend, op, size)

    def job_events(self, job: Job, events: list[JobEvent]) -> None:
        record_job_events(job, events)
        record_usage(job, events)


LISTENER = PrometheusListener()


def install() -> None:
    """Count this process's telemetry in Prometheus (idempotent); the API and the workers call it at start."""
    telemetry.add_listener(LISTENER)
    commit_listeners.add(LISTENER.job_events)


def process_memory() -> dict[str, int]:
    """Device -> bytes this process holds: 'cpu' (resident set) and 'cuda:N' for GPUs torch uses.

    torch is consulted only when this process already imported it and initialised CUDA, so the
    API never imports torch to answer a scrape.
    """
    memory = {"cpu": _rss_bytes()}
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                for index in range(torch.cuda.device_count()):
                    reserved = int(torch.cuda.memory_reserved(index))
                    if reserved:
                        memory[f"cuda:{index}"] = reserved
        except Exception:
            log.debug("could not read CUDA memory", exc_info=True)
    return memory


def record_engine_memory(pipeline: str, stage: str, engine: str) -> dict[str, int]:
    """Set the engine-memory gauge of a stage from what this process holds now; returns the values."""
    memory = process_memory()
    for device, value in memory.items():
        ENGINE_MEMORY.labels(pipeline, stage, engine, device).set(value)
    return memory


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # peak, in KiB on Linux


# --- values read from Redis at scrape time (API only) ---
class QueueCollector(Collector):
    """Per queue: steps waiting and running (from the job store: what to scale on), messages in the
    broker, and live workers."""

    def __init__(self, broker: redis.Redis, state: redis.Redis, queues: Callable[[], Iterable[str]],
                 counts: Callable[[str], tuple[int, int]] | None = None, *, tenants: bool = True) -> None:
        # ``counts`` also turns on the scheduler's gauges (ready stages per tenant, released stages).
        """``counts``: queue -> (steps waiting, steps running), from the job store's queue indexes.
        ``tenants``: label the ready stages by tenant; else one series per queue (a scrape that did not
        authenticate is not told the tenants' names: OMNI_METRICS_TOKEN)."""
        self.broker = broker
        self.state = state
        self.queues = queues
        self.counts = counts
        self.tenants = tenants

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from omni_jobs.dispatch.queue_depth import queue_depths
        from omni_jobs.dispatch.worker_registry import live_workers

        queues = set(self.queues())
        depth = GaugeMetricFamily("omni_jobs_queue_depth", "Messages waiting in a stage queue (not yet taken by "
                                  "a worker), read from the Redis broker.", labels=["queue"])
        workers = GaugeMetricFamily("omni_jobs_queue_workers", "Live workers listening on a queue (heartbeats).",
                                    labels=["queue"])
        waiting = GaugeMetricFamily("omni_jobs_queue_waiting", "Steps queued on a queue and not yet started "
                                    "(including retries waiting out their backoff).", labels=["queue"])
        running = GaugeMetricFamily("omni_jobs_queue_running", "Steps running on a queue's workers (holding a "
                                    "lease). Waiting + running is the work to scale a queue's workers on.",
                                    labels=["queue"])
        try:
            for queue, n in queue_depths(self.broker, queues).items():
                depth.add_metric([queue], n)
            if self.counts is not None:
                for queue in sorted(queues):
                    w, r = self.counts(queue)
                    waiting.add_metric([queue], w)
                    running.add_metric([queue], r)
                ready, released = self._scheduler(queues)
            live = live_workers(self.state)
            for queue in sorted(queues | set(live)):
                workers.add_metric([queue], len(live.get(queue, [])))
        except Exception as exc:  # noqa: BLE001 - a scrape must answer even with Redis down
            log.warning("queue metrics unavailable: %s", exc)
            return
        yield depth
        yield workers
        if self.counts is not None:
            yield waiting
            yield running
            yield ready
            yield released

    def _scheduler(self, queues: set[str]) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        """Per queue and tenant: first attempts waiting for the scheduler; per queue: released, not started."""
        from omni_jobs.core import keys
        from omni_jobs.core.redis_replies import members

        ready = GaugeMetricFamily("omni_jobs_queue_ready", "Stages waiting for the scheduler to release them "
                                  "to a queue, per tenant (docs/scaling.md, \"Scheduling\"; per queue only, without the "
                                  "scrape token).", labels=["queue", "tenant"] if self.tenants else ["queue"])
        released = GaugeMetricFamily("omni_jobs_queue_released", "Stages released to a queue's broker list and "
                                     "not started yet.", labels=["queue"])
        for queue in sorted(queues):
            counts = {tenant: self.state.zcard(keys.queue_ready(queue, tenant))
                      for tenant in members(self.state.zrange(keys.queue_tenants(queue), 0, -1))}
            if self.tenants:
                for tenant, n in counts.items():
                    ready.add_metric([queue, tenant], n)
            else:
                ready.add_metric([queue], sum(counts.values()))
            released.add_metric([queue], self.state.zcard(keys.queue_released(queue)))
        return ready, released


# --- exposition ---
def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def process_registry() -> CollectorRegistry:
    """The registry to serve: this process's, or the sum over every process in multiprocess mode."""
    if multiprocess_dir() is None:
        return REGISTRY
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # prometheus_client leaves it untyped
    return registry


class WithoutTenants(Collector):
    """A registry's metric families but those labelled by tenant (the usage counters): what a scrape that did
    not authenticate may read (OMNI_METRICS_TOKEN), which names no tenant."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            if not any("tenant" in sample.labels for sample in family.samples):
                yield family


def render(*extra: Collector, tenants: bool = True) -> tuple[bytes, str]:
    """The text exposition of this process's metrics plus the extra collectors (read once, now); without
    ``tenants``, no series labelled by tenant."""
    registry = process_registry()
    if not tenants:
        filtered = CollectorRegistry(auto_describe=False)
        filtered.register(WithoutTenants(registry))
        registry = filtered
    body = generate_latest(registry)
    if extra:
        registry = CollectorRegistry(auto_describe=False)
        for collector in extra:
            registry.register(collector)
        body += generate_latest(registry)
    return body, CONTENT_TYPE_LATEST


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> WSGIServer:
    """Serve this process's metrics on ``port`` (a worker's OMNI_METRICS_PORT); returns the server."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=addr, registry=process_registry())
    return server


def prepare_multiprocess_dir() -> None:
    """Multiprocess mode, at worker start: create the directory and drop an earlier run's files."""
    path = multiprocess_dir()
    if path is None:
        return
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name.endswith(".db"):
            os.remove(os.path.join(path, name))


def mark_process_dead(pid: int) -> None:
    """Multiprocess mode: drop a finished child's live gauges (called when a prefork child exits)."""
    if multiprocess_dir() is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]  # prometheus_client leaves it untyped
