"""Usage per tenant: what each tenant's jobs used, by UTC day, for operators who bill (GET /v1/usage).

One pure function (:func:`increments`) reads a job commit's events and says what they add: jobs by
status (``queued`` counts every job made), stage-seconds per queue (a succeeded stage's run, and a failed job's
failing stage until the failure: the attempts that ended it, as omni_jobs.report.metrics counts them), tokens in and out (an AR stage's ``prompt_tokens`` / ``completion_tokens``
metrics), images, audio seconds and video frames (a succeeded job's outputs). Two listeners count the same
increments: :class:`UsageRecorder` in Redis (a hash per tenant and day, read back here; written once a second
from a tally, off the committing thread), and the Prometheus counters of omni_jobs.report.metrics. Like those counters, it counts what the committing process saw: a commit
whose listener never ran (the process died right after it) is not counted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import redis

from omni_jobs.core import keys
from omni_jobs.core.json_types import JsonObject, JsonValue
from omni_jobs.core.redis_replies import members, text_hash
from omni_jobs.jobs import commit_listeners
from omni_jobs.jobs.models import EventType, Job, JobEvent, StageRecord

log = logging.getLogger(__name__)
DAY_S = 24 * 3600
_FINAL = {"job.succeeded": "succeeded", "job.failed": "failed", "job.canceled": "canceled", "job.queued": "queued"}


@dataclass(frozen=True)
class Increment:
    """``amount`` more of ``field`` for ``tenant`` on UTC ``day``."""

    tenant: str
    day: str
    field: str
    amount: float


def day_of(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d")


def increments(job: Job, events: Sequence[JobEvent]) -> list[Increment]:
    """What one commit of ``job`` (its events, the job as it is after them) adds to its tenant's usage."""
    found: list[Increment] = []

    def add(at: float, field: str, amount: float) -> None:
        if amount:
            found.append(Increment(job.tenant, day_of(at), field, amount))

    for event in events:
        kind = event.type.value if isinstance(event.type, EventType) else event.type
        if kind in _FINAL:
            add(event.at, f"jobs:{_FINAL[kind]}", 1)
        if kind == "stage.succeeded":
            record = _record(job, event.data.get("stage"))
            if record is not None:
                if record.duration_s is not None:
                    add(event.at, f"stage_seconds:{record.queue}", record.duration_s)
                add(event.at, "tokens_in", record.metrics.get("prompt_tokens", 0.0))
                add(event.at, "tokens_out", record.metrics.get("completion_tokens", 0.0))
        if kind == "job.failed":  # the failing stage ran until the failure (as metrics.STAGE_DURATION counts it)
            error = event.data.get("error")
            record = _record(job, error.get("stage") if isinstance(error, dict) else None)
            if record is not None and record.started_at is not None:
                add(event.at, f"stage_seconds:{record.queue}", max(0.0, event.at - record.started_at))
        if kind == "job.succeeded":
            for out in job.outputs:
                if out.type == "image":
                    add(event.at, "images", 1)
                elif out.type == "audio" and out.duration_s:
                    add(event.at, "audio_seconds", out.duration_s)
                elif out.type == "video" and out.frames:
                    add(event.at, "video_frames", out.frames)
    return found


def _record(job: Job, stage: object) -> StageRecord | None:
    if not isinstance(stage, str) or not stage:
        return None
    try:
        return job.stage_record(stage)
    except KeyError:
        return None


class UsageRecorder:
    """Counts usage in Redis (``keys.usage``). A commit only adds its increments to this process's tally (a dict
    under a lock: no I/O on the committing thread, which for a submit is the API's event loop); a daemon thread
    writes the tally every ``flush_s`` in one pipeline. A process killed meanwhile loses its last ``flush_s`` of
    counts, as its Prometheus counters lose theirs."""

    def __init__(self, client: redis.Redis, *, ttl_s: int = 400 * DAY_S, flush_s: float = 1.0) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self.flush_s = flush_s
        self._tally: dict[tuple[str, str, str], float] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def job_events(self, job: Job, events: list[JobEvent]) -> None:
        found = increments(job, events)
        if not found:
            return
        with self._lock:
            for inc in found:
                key = (inc.tenant, inc.day, inc.field)
                self._tally[key] = self._tally.get(key, 0.0) + inc.amount
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._start()

    def flush(self) -> int:
        """Write the tally to Redis now; returns how many fields were written. What cannot be written (Redis
        away) goes back into the tally for the next flush."""
        with self._lock:
            tally, self._tally = self._tally, {}
        if not tally:
            return 0
        try:
            with self.client.pipeline(transaction=True) as pipe:
                for (tenant, day, field), amount in tally.items():
                    key = keys.usage(tenant, day)
                    pipe.hincrbyfloat(key, field, amount)
                    pipe.expire(key, self.ttl_s)
                pipe.sadd(keys.USAGE_TENANTS, *{tenant for tenant, _day, _field in tally})
                pipe.execute()
        except redis.RedisError:
            with self._lock:
                for held, amount in tally.items():
                    self._tally[held] = self._tally.get(held, 0.0) + amount
            raise
        return len(tally)

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
                return
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._loop, name="omni-usage-flush", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.flush_s)
            try:
                self.flush()
            except Exception:
                log.warning("usage: cannot write the tally yet", exc_info=True)


_installed: list[UsageRecorder] = []


def install(client: redis.Redis) -> UsageRecorder:
    """Count this process's job commits in Redis; the API and the workers call it at start. One recorder per
    process: a later install (another app in the same process, as tests make) replaces the earlier one, so
    that no commit is counted twice."""
    for earlier in _installed:
        if earlier.client is client:
            return earlier
        commit_listeners.remove(earlier.job_events)
    recorder = UsageRecorder(client)
    _installed[:] = [recorder]
    commit_listeners.add(recorder.job_events)
    return recorder


def flush_pending() -> None:
    """Write this process's tally now (a read of usage in the same process then includes its own last commits)."""
    for recorder in _installed:
        recorder.flush()


def _bucket(fields: dict[str, str]) -> JsonObject:
    jobs: JsonObject = {}
    stage_seconds: JsonObject = {}
    totals: dict[str, float] = {"tokens_in": 0.0, "tokens_out": 0.0, "images": 0.0, "audio_seconds": 0.0,
                                "video_frames": 0.0}
    for name, raw in fields.items():
        value = float(raw)
        if name.startswith("jobs:"):
            jobs[name[5:]] = int(value)
        elif name.startswith("stage_seconds:"):
            stage_seconds[name[14:]] = round(value, 3)
        elif name in totals:
            totals[name] = value
    return {"jobs": jobs, "stage_seconds": stage_seconds,
            "tokens": {"input": int(totals["tokens_in"]), "output": int(totals["tokens_out"])},
            "images": int(totals["images"]), "audio_seconds": round(totals["audio_seconds"], 3),
            "video_frames": int(totals["video_frames"])}


def read_usage(client: redis.Redis, *, tenants: Iterable[str] | None, start: float, end: float) -> JsonObject:
    """Daily buckets from ``start`` to ``end`` (UTC days touching [start, end)), each with one result per tenant
    that used something that day. ``tenants``: whose (None: every tenant with usage, an admin's view)."""
    if end <= start:
        raise ValueError("end must be after start")
    if end - start > 366 * DAY_S:
        raise ValueError("at most 366 days at once")
    chosen = sorted(tenants) if tenants is not None else sorted(members(client.smembers(keys.USAGE_TENANTS)))
    first = int(start // DAY_S) * DAY_S
    days = list(range(first, int(end), DAY_S))
    with client.pipeline(transaction=False) as pipe:
        for day in days:
            for tenant in chosen:
                pipe.hgetall(keys.usage(tenant, day_of(day)))
        replies = iter(pipe.execute())
    data: list[JsonValue] = []
    for day in days:
        results: list[JsonValue] = []
        for tenant in chosen:
            fields = text_hash(next(replies))
            if fields:
                results.append({"object": "usage.tenant", "tenant": tenant, **_bucket(fields)})
        data.append({"object": "bucket", "start_time": day, "end_time": day + DAY_S, "results": results})
    return {"object": "page", "bucket": "day", "data": data, "generated_at": int(time.time())}
