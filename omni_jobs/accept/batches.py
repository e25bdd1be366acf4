"""Batches (OpenAI's Batch API): a file of requests run as low-priority jobs, its results as files.

A batch is a Redis hash (``keys.batch``) with its OpenAI fields, a cursor (the next line to submit) and
its counts. A driver (:class:`BatchDriver`, a thread in every results worker) advances each unsettled
batch in passes, one process at a time per batch (a lock with a TTL), and every pass can be cut short
by a crash anywhere and run again:

- **submit**: the lines from the cursor, each as the job(s) its route would submit, at priority
  ``low`` (the scheduler and the tenant's quotas apply: a 429 or a full queue stops the pass and the
  next one tries again), with the Idempotency-Key ``batch:<id>:<line>``: a line submitted again after
  a crash answers its first job. At most OMNI_BATCH_MAX_IN_FLIGHT lines have unended jobs, so a batch
  holds that many jobs in Redis whatever its size. Recording a line (its job ids, or the error that
  refused it) is one script that writes it only once (HSETNX), so nothing is counted twice.
- **settle**: the lines whose jobs all ended leave the pending set, counted once by the same script.
- **finalize**: once every line is recorded and settled, the output and error files are made in one go,
  in line order, from the lines' ended jobs (omni_jobs.accept.batch_results): each line is in exactly one of
  them by construction. Their ids derive from the batch's, so a finalize run again rewrites the same
  files; the status, the files and the exact counts are then written in one transaction.
- **webhook**: ``batch.completed`` / ``failed`` / ``expired`` / ``cancelled``, signed as the job webhooks
  are (Standard Webhooks), retried on the same schedule with the same ``webhook-id`` until delivered.

A cancel or the end of the completion window stops the submitting, cancels the lines' running jobs,
and finalizes with the lines never run in the error file (``batch_cancelled``, ``batch_expired``).
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis
from redis.typing import EncodableT, FieldT

from omni_jobs.accept.batch_lines import (
    ENDPOINTS,
    FileSummary,
    LinePlan,
    LinePlanner,
    LineRefused,
    RequestLine,
    check_file,
    iter_lines,
    read_line,
    split_lines,
)
from omni_jobs.accept.batch_results import Shaping, error_line, line_result
from omni_jobs.accept.files import FileNotFound, FileRecord, FileStore
from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.accept.openai_requests import invalid_request
from omni_jobs.accept.submission import JobSubmitter
from omni_jobs.core import keys
from omni_jobs.core.errors import (
    IdempotencyConflict,
    InvalidRequest,
    JobAlreadyFinished,
    JobNotFound,
    Overloaded,
    QuotaExceeded,
)
from omni_jobs.core.json_types import JsonObject, JsonValue
from omni_jobs.core.redis_replies import members, text_hash
from omni_jobs.jobs.models import Job
from omni_jobs.report.webhooks import EVENT_HEADER, REFUSED, AttemptResult, RetryPolicy, WebhookSigner

log = logging.getLogger(__name__)

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")
WINDOWS = {"24h": 24 * 3600}
"""completion_window -> seconds (OpenAI takes only 24h)."""
FINAL_JOB = frozenset({"succeeded", "failed", "canceled"})
TIMESTAMPS = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
              "expired_at", "cancelling_at", "cancelled_at")
CHUNK = 500
"""Lines read together at finalize (one HMGET, one read of their jobs)."""
MAX_METADATA = 16
SWEEP_EVERY_S = 60.0
"""How often a driver deletes expired files' bytes (FileStore.sweep)."""
EXPIRED_MESSAGE = "this request could not be executed before the completion window expired"

_RECORD = """
local fresh = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
if fresh == 1 then
  if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[3], 'failed', 1) else redis.call('SADD', KEYS[2], ARGV[1]) end
end
local cursor = tonumber(redis.call('HGET', KEYS[3], 'cursor') or '0')
if cursor < tonumber(ARGV[1]) + 1 then redis.call('HSET', KEYS[3], 'cursor', tonumber(ARGV[1]) + 1) end
return fresh
"""
"""Record line ARGV[1] once: its job ids (pending) or its error (ARGV[3] = 1: failed), and move the cursor past it."""

_SETTLE = """
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('SREM', KEYS[1], ARGV[i]) == 1 then redis.call('HINCRBY', KEYS[2], ARGV[i + 1], 1); n = n + 1 end
end
return n
"""
"""Lines whose jobs ended leave the pending set, each counted once (completed or failed)."""

_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output (``output``) or error (``errors``) file: fixed, so a rerun rewrites it."""
    return f"file-{batch_id.removeprefix('batch_')}-{kind}"


def _int(value: str | None) -> int | None:
    return int(float(value)) if value else None


def as_openai(fields: dict[str, str]) -> JsonObject:
    """The batch as OpenAI's ``batch`` object."""
    errors = json.loads(fields["errors"]) if fields.get("errors") else None
    body: JsonObject = {
        "id": fields["id"], "object": "batch", "endpoint": fields["endpoint"], "errors": errors,
        "input_file_id": fields["input_file_id"], "completion_window": fields["completion_window"],
        "status": fields["status"], "output_file_id": fields.get("output_file_id") or None,
        "error_file_id": fields.get("error_file_id") or None,
        "request_counts": {"total": int(fields.get("total") or 0), "completed": int(fields.get("completed") or 0),
                           "failed": int(fields.get("failed") or 0)},
        "metadata": json.loads(fields["metadata"]) if fields.get("metadata") else None,
    }
    for name in TIMESTAMPS:
        body[name] = _int(fields.get(name))
    return body


@dataclass(frozen=True)
class BatchWebhook:
    """Where a batch's end is announced, and how: the signer and one POST (through the SSRF guard)."""

    signer: WebhookSigner
    post: Callable[[str, bytes, dict[str, str]], AttemptResult]
    policy: RetryPolicy


class FileLines:
    """A batch file's lines as raw bytes, each read (parsed) when it is used: a process holds a running batch's
    file, not a parsed object per line (a 50,000-line file would be ~100 MB of dicts)."""

    def __init__(self, raw: list[bytes]) -> None:
        self.raw = raw

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, index: int) -> RequestLine:
        return read_line(index, self.raw[index])


class Batches:
    """Create, read, cancel and advance batches (the routes call the first three, the driver ``advance``)."""

    def __init__(self, redis_client: redis.Redis, *, files: FileStore, planner: LinePlanner,
                 submitter: JobSubmitter, get_jobs: Callable[[Sequence[str]], list[Job | None]],
                 cancel_job: Callable[[str, str], object], shaping: Shaping, max_in_flight: int,
                 max_lines: int, webhook: BatchWebhook | None = None,
                 job_statuses: Callable[[Sequence[str]], list[str | None]] | None = None) -> None:
        """``job_statuses``: each job's status (None: gone), read often for the pending lines: by default
        from ``get_jobs``; redis_job_statuses reads the one field of each job hash instead."""
        self.redis = redis_client
        self.files = files
        self.planner = planner
        self.submitter = submitter
        self.get_jobs = get_jobs
        self.job_statuses = job_statuses or (
            lambda ids: [job.status.value if job is not None else None for job in get_jobs(ids)])
        self.cancel_job = cancel_job
        self.shaping = shaping
        self.max_in_flight = max_in_flight
        self.max_lines = max_lines
        self.webhook = webhook
        self._record = redis_client.register_script(_RECORD)
        self._settle = redis_client.register_script(_SETTLE)
        self._unlock = redis_client.register_script(_UNLOCK)
        self._renew = redis_client.register_script(_RENEW)
        self._lines: dict[str, FileLines] = {}
        """A running batch's lines, read once per process (dropped at finalize)."""

    # --- files ---
    def check_file(self, data: bytes) -> FileSummary:
        """Every line of an upload checked as its route would (BatchFileInvalid names the lines at fault)."""
        return check_file(data, self.planner.plan, max_lines=self.max_lines)

    # --- the routes' side ---
    def create(self, tenant: str, *, input_file_id: object, endpoint: object, completion_window: object,
               metadata: object = None, webhook: object = None, api_key_id: str | None = None) -> JsonObject:
        """A new batch (``validating``); OpenAIError 400 naming the field, or the lines whose url is not
        ``endpoint``; 404 for a file this tenant does not have."""
        if endpoint not in ENDPOINTS:
            raise OpenAIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}",
                              param="endpoint", code="invalid_endpoint")
        if completion_window not in WINDOWS:
            raise OpenAIError(400, f"completion_window must be one of {', '.join(WINDOWS)}; got {completion_window!r}",
                              param="completion_window")
        meta = _metadata(metadata)
        if not isinstance(input_file_id, str):
            raise OpenAIError(400, "input_file_id is required: the id of a file uploaded with purpose 'batch'",
                              param="input_file_id")
        try:
            record = self.files.get(tenant, input_file_id)
        except FileNotFound:
            raise OpenAIError(404, f"no file {input_file_id!r}", param="input_file_id", code="file_not_found") from None
        hook = None
        if webhook is not None:  # after the file: a missing file is the first thing to say
            if self.webhook is None:
                raise OpenAIError(400, "this server has no webhook signing secret (OMNI_WEBHOOK_SECRET), so it sends "
                                  "no webhooks", param="webhook", code="webhooks_disabled")
            try:
                hook = self.submitter.validate_webhook(webhook, None)
            except InvalidRequest as exc:
                raise OpenAIError(400, f"webhook: {exc.errors[0].message}", param="webhook") from None
        if record.purpose != "batch":
            raise OpenAIError(400, f"file {input_file_id!r} has purpose {record.purpose!r}; a batch's input has "
                              "purpose 'batch'", param="input_file_id")
        data = self.files.artifacts.get(record.artifact)
        wrong = [line.index + 1 for line in iter_lines(data) if line.url != endpoint]
        if wrong:
            shown = ", ".join(map(str, wrong[:20])) + (f" (and {len(wrong) - 20} more)" if len(wrong) > 20 else "")
            raise OpenAIError(400, f"the batch's endpoint is {endpoint}, but lines {shown} of {input_file_id} name "
                              "another url: every line's url is the batch's endpoint", param="endpoint",
                              code="mismatched_endpoint")
        batch_id = new_batch_id()
        now = time.time()
        fields = {"id": batch_id, "tenant": tenant, "endpoint": str(endpoint), "input_file_id": input_file_id,
                  "completion_window": str(completion_window), "status": "validating", "created_at": str(int(now)),
                  "expires_at": str(int(now) + WINDOWS[str(completion_window)]), "total": str(record.lines),
                  "completed": "0", "failed": "0", "cursor": "0", "metadata": json.dumps(meta) if meta else "",
                  "api_key_id": api_key_id or "", "webhook_url": hook.url if hook is not None else ""}
        self.files.records.put(keys.batch(batch_id), fields, indexes=[keys.tenant_batches(tenant), keys.BATCHES_ACTIVE],
                               member=batch_id, score=now)
        return as_openai(fields)

    def fields(self, tenant: str, batch_id: str) -> dict[str, str]:
        fields = text_hash(self.redis.hgetall(keys.batch(batch_id)))
        if not fields or fields.get("tenant") != tenant:
            raise OpenAIError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
        return fields

    def get(self, tenant: str, batch_id: str) -> JsonObject:
        return as_openai(self.fields(tenant, batch_id))

    def page(self, tenant: str, *, after: str | None = None, limit: int = 20) -> JsonObject:
        """OpenAI's list: newest first, ``after`` the id the page starts past, ``has_more``."""
        start = 0
        if after:
            rank = self.redis.zrevrank(keys.tenant_batches(tenant), after)
            if rank is None:
                raise OpenAIError(404, f"after: no batch {after!r} (the last id of the previous page)", param="after",
                                  code="batch_not_found")
            start = int(str(rank)) + 1
        ids = members(self.redis.zrevrange(keys.tenant_batches(tenant), start, start + limit))
        data: list[JsonValue] = []
        for batch_id in ids[:limit]:
            fields = text_hash(self.redis.hgetall(keys.batch(batch_id)))
            if fields:
                data.append(as_openai(fields))
        first, last = (ids[0], ids[min(limit, len(ids)) - 1]) if data else (None, None)
        return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": len(ids) > limit}

    def cancel(self, tenant: str, batch_id: str) -> JsonObject:
        """``cancelling`` now (the driver cancels its jobs and finalizes it ``cancelled``); a batch that
        ended is 409, one already cancelling or cancelled is answered as it is."""
        key = keys.batch(batch_id)
        while True:
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]  # redis-py leaves Pipeline.watch untyped
                    fields = self.fields(tenant, batch_id)
                    status = fields["status"]
                    if status in ("cancelling", "cancelled"):
                        return as_openai(fields)
                    if status not in ("validating", "in_progress"):
                        raise OpenAIError(409, f"batch {batch_id} is {status}: only a validating or in_progress "
                                          "batch can be cancelled", param="batch_id", code="batch_not_cancellable")
                    fields.update(status="cancelling", cancelling_at=str(int(time.time())))
                    pipe.multi()
                    pipe.hset(key, mapping={"status": "cancelling", "cancelling_at": fields["cancelling_at"]})
                    pipe.execute()
                    return as_openai(fields)
                except redis.WatchError:
                    continue

    # --- the driver's side ---
    def advance(self, batch_id: str, keep: Callable[[], None] = lambda: None) -> None:
        """One pass over one batch; safe to cut short anywhere and run again. ``keep``: called between pieces
        of a long pass (it renews the batch's lock)."""
        fields = text_hash(self.redis.hgetall(keys.batch(batch_id)))
        if not fields:
            self.redis.zrem(keys.BATCHES_ACTIVE, batch_id)
            return
        status = fields["status"]
        if status in FINAL:
            self._announce(fields)
            return
        try:
            lines = self._lines_of(fields)
        except (FileNotFound, OpenAIError, ValueError) as exc:
            self._fail(fields, f"the input file cannot be read: {exc}")
            return
        if status == "validating":
            self.redis.hset(keys.batch(batch_id), mapping={"status": "in_progress", "total": str(len(lines)),
                                                           "in_progress_at": str(int(time.time()))})
            fields.update(status="in_progress")
        ending = self._ending(fields)
        self._settle_pending(fields, cancel=ending != "completed")
        if ending == "completed":
            self._submit(fields, lines, keep)
        fields = text_hash(self.redis.hgetall(keys.batch(batch_id)))
        done = int(fields.get("cursor") or 0) >= len(lines) or ending != "completed"
        if done and not self.redis.scard(keys.batch_pending(batch_id)):
            self._finalize(fields, lines, ending, keep)

    def _ending(self, fields: dict[str, str]) -> str:
        """How the batch ends once its running jobs ended: completed, or cancelled, or expired."""
        if fields["status"] == "cancelling":
            return "cancelled"
        if fields["status"] != "finalizing" and time.time() > float(fields["expires_at"]):
            return "expired"
        return "completed"

    def _lines_of(self, fields: dict[str, str]) -> FileLines:
        batch_id = fields["id"]
        lines = self._lines.get(batch_id)
        if lines is None:
            record: FileRecord = self.files.get(fields["tenant"], fields["input_file_id"])
            lines = self._lines[batch_id] = FileLines(split_lines(self.files.artifacts.get(record.artifact)))
        return lines

    def _submit(self, fields: dict[str, str], lines: FileLines, keep: Callable[[], None]) -> None:
        """Submit lines from the cursor while fewer than max_in_flight are pending; a quota or a full queue
        ends the pass (the next one tries again)."""
        batch_id = fields["id"]
        cursor = int(fields.get("cursor") or 0)
        room = self.max_in_flight - int(self.redis.scard(keys.batch_pending(batch_id)))
        while cursor < len(lines) and room > 0:
            if cursor % 50 == 0:
                keep()
            line = lines[cursor]
            try:
                ids = self._submit_line(fields, line)
            except (QuotaExceeded, Overloaded) as exc:
                log.debug("batch %s: line %d waits: %s", batch_id, cursor + 1, exc)
                return
            except LineRefused as exc:
                self._record(keys=[keys.batch_lines(batch_id), keys.batch_pending(batch_id), keys.batch(batch_id)],
                             args=[cursor, "!" + json.dumps({"code": exc.code, "message": exc.message}), 1])
            else:
                self._record(keys=[keys.batch_lines(batch_id), keys.batch_pending(batch_id), keys.batch(batch_id)],
                             args=[cursor, ",".join(ids), 0])
                room -= 1
            cursor += 1

    def _submit_line(self, fields: dict[str, str], line: RequestLine) -> list[str]:
        plan = self.planner.plan(line.url, line.body)
        key = f"batch:{fields['id']}:{line.index}"
        tenant, key_id = fields["tenant"], fields.get("api_key_id") or None
        try:
            if len(plan.params) == 1:
                job = self.submitter.submit(plan.pipeline, plan.input, plan.params[0], idempotency_key=key,
                                            webhook=plan.webhook, webhook_events_filter=plan.webhook_events_filter,
                                            tenant=tenant, priority="low", api_key_id=key_id)
                return [job.id]
            jobs = self.submitter.submit_all(plan.pipeline, plan.input, plan.params,
                                             idempotency_keys=[f"{key}:{i}" for i in range(len(plan.params))],
                                             tenant=tenant, api_key_id=key_id, priority="low")
            return [job.id for job in jobs]
        except InvalidRequest as exc:  # what only a submit checks: a media part that does not decode
            if plan.openai is not None:
                error = invalid_request(exc, plan.openai)
                raise LineRefused(error.message, error.param, error.code or "invalid_request") from None
            first = exc.errors[0]
            raise LineRefused(f"body.{'.'.join(map(str, first.loc))}: {first.message}", None, first.type) from None
        except IdempotencyConflict as exc:
            raise LineRefused(str(exc), None, "idempotency_conflict") from None

    def _settle_pending(self, fields: dict[str, str], *, cancel: bool) -> None:
        """Move the lines whose jobs all ended out of the pending set (counted once); ``cancel``: cancel the
        jobs still running (a cancelled or expired batch)."""
        batch_id = fields["id"]
        pending = members(self.redis.smembers(keys.batch_pending(batch_id)))
        if not pending:
            return
        values = self.redis.hmget(keys.batch_lines(batch_id), pending)
        job_ids = {idx: (v.decode() if isinstance(v, bytes) else str(v or "")).split(",")
                   for idx, v in zip(pending, values, strict=True)}
        flat = [(idx, job_id) for idx, ids in job_ids.items() for job_id in ids if job_id]
        statuses = self.job_statuses([job_id for _idx, job_id in flat])
        by_line: dict[str, list[str | None]] = {}
        for (idx, job_id), state in zip(flat, statuses, strict=True):
            by_line.setdefault(idx, []).append(state)
            if cancel and state is not None and state not in FINAL_JOB:
                try:
                    self.cancel_job(job_id, f"batch {batch_id} was {'cancelled' if fields['status'] == 'cancelling' else 'expired'}")
                except (JobAlreadyFinished, JobNotFound):
                    pass
        args: list[str] = []
        for idx, states in by_line.items():
            if all(s is None or s in FINAL_JOB for s in states):
                args += [idx, "completed" if all(s == "succeeded" for s in states) else "failed"]
        if args:
            self._settle(keys=[keys.batch_pending(batch_id), keys.batch(batch_id)], args=args)

    def _finalize(self, fields: dict[str, str], lines: FileLines, ending: str,
                  keep: Callable[[], None]) -> None:
        """The output and error files from every line in order, then the end in one transaction."""
        batch_id = fields["id"]
        now = str(int(time.time()))
        if ending == "completed" and fields["status"] != "finalizing":
            self.redis.hset(keys.batch(batch_id), mapping={"status": "finalizing", "finalizing_at": now})
        never = {"cancelled": ("batch_cancelled", "the batch was cancelled before this request ran"),
                 "expired": ("batch_expired", EXPIRED_MESSAGE)}.get(ending, ("batch_failed", "this request was not run"))
        out: list[bytes] = []
        err: list[bytes] = []
        for start in range(0, len(lines), CHUNK):
            keep()
            chunk = [lines[index] for index in range(start, min(start + CHUNK, len(lines)))]
            values = self.redis.hmget(keys.batch_lines(batch_id), [line.index for line in chunk])
            recorded = [v.decode() if isinstance(v, bytes) else v for v in values]
            wanted = [job_id for v in recorded if v and not v.startswith("!") for job_id in v.split(",")]
            jobs = dict(zip(wanted, self.get_jobs(wanted), strict=True)) if wanted else {}
            for line, value in zip(chunk, recorded, strict=True):
                ok, result = self._result(batch_id, line, value, jobs, never)
                (out if ok else err).append(json.dumps(result, separators=(",", ":"), ensure_ascii=False).encode())
        tenant = fields["tenant"]
        ids: dict[str, str] = {"output_file_id": "", "error_file_id": ""}
        for name, rows, kind in (("output_file_id", out, "output"), ("error_file_id", err, "errors")):
            if rows:
                record = self.files.put(tenant, b"\n".join(rows) + b"\n", filename=f"{batch_id}_{kind}.jsonl",
                                        purpose="batch_output", lines=len(rows),
                                        file_id=output_file_id(batch_id, kind))
                ids[name] = record.id
        ended = {"status": ending, f"{ending}_at": str(int(time.time())), "completed": str(len(out)),
                 "failed": str(len(err)), "cursor": str(len(lines)), **ids}
        if fields.get("webhook_url"):
            ended.update(webhook_status="pending", webhook_attempts="0", webhook_next_at="0",
                         webhook_id=f"msg_{batch_id.removeprefix('batch_')}_{ending}")
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.batch(batch_id), mapping=_mapping(ended))
            pipe.delete(keys.batch_pending(batch_id))
            for key in (keys.batch(batch_id), keys.batch_lines(batch_id)):  # kept as long as its files
                pipe.expire(key, self.files.ttl_s)
            if not fields.get("webhook_url"):
                pipe.zrem(keys.BATCHES_ACTIVE, batch_id)
            pipe.execute()
        self._lines.pop(batch_id, None)
        log.info("batch %s %s: %d completed, %d failed", batch_id, ending, len(out), len(err))
        if fields.get("webhook_url"):
            self._announce({**fields, **ended})

    def _result(self, batch_id: str, line: RequestLine, value: str | None, jobs: dict[str, Job | None],
                never: tuple[str, str]) -> tuple[bool, JsonObject]:
        if value is None:
            return False, error_line(batch_id, line, *never)
        if value.startswith("!"):
            refused = json.loads(value[1:])
            return False, error_line(batch_id, line, str(refused["code"]), str(refused["message"]))
        try:
            plan: LinePlan = self.planner.plan(line.url, line.body)
        except LineRefused as exc:  # the catalogue changed since the line was submitted
            return False, error_line(batch_id, line, exc.code, exc.message)
        return line_result(batch_id, line, plan, [jobs.get(job_id) for job_id in value.split(",")], self.shaping)

    def _fail(self, fields: dict[str, str], message: str) -> None:
        """A batch that cannot run at all (its input file went): ``failed``, with OpenAI's ``errors``."""
        error: JsonObject = {"code": "invalid_file", "message": message, "param": "input_file_id", "line": None}
        errors: JsonObject = {"object": "list", "data": [error]}
        ended = {"status": "failed", "failed_at": str(int(time.time())), "errors": json.dumps(errors)}
        if fields.get("webhook_url"):
            ended.update(webhook_status="pending", webhook_attempts="0", webhook_next_at="0",
                         webhook_id=f"msg_{fields['id'].removeprefix('batch_')}_failed")
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.batch(fields["id"]), mapping=_mapping(ended))
            pipe.expire(keys.batch(fields["id"]), self.files.ttl_s)
            if not fields.get("webhook_url"):
                pipe.zrem(keys.BATCHES_ACTIVE, fields["id"])
            pipe.execute()

    def _announce(self, fields: dict[str, str]) -> None:
        """One due attempt of the batch's webhook (batch.<status>); the batch leaves the active set once it
        was delivered or given up."""
        batch_id = fields["id"]
        if fields.get("webhook_status") != "pending" or self.webhook is None:
            self.redis.zrem(keys.BATCHES_ACTIVE, batch_id)
            return
        if time.time() < float(fields.get("webhook_next_at") or 0):
            return
        attempt = int(fields.get("webhook_attempts") or 0) + 1
        event = f"batch.{fields['status']}"
        message_id = fields["webhook_id"]
        body = json.dumps({"id": message_id, "object": "event", "type": event, "created_at": int(time.time()),
                           "data": as_openai(fields)}, separators=(",", ":")).encode()
        headers = {"content-type": "application/json", EVENT_HEADER: event,
                   **self.webhook.signer.headers(message_id, int(time.time()), body)}
        result = self.webhook.post(fields["webhook_url"], body, headers)
        update = {"webhook_attempts": str(attempt), "webhook_last_error": result.error or "",
                  "webhook_last_status": str(result.status_code or "")}
        refused = result.error is not None and result.error.startswith(REFUSED)
        done = result.ok or refused or not result.retryable or attempt >= self.webhook.policy.max_attempts
        if result.ok:
            update["webhook_status"] = "delivered"
        elif done:
            update["webhook_status"] = "gave_up" if result.retryable and not refused else "rejected"
            log.warning("batch %s: webhook %s %s: %s", batch_id, event, update["webhook_status"], result.error)
        else:
            update["webhook_next_at"] = str(time.time() + self.webhook.policy.delay(attempt, result.retry_after_s))
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.batch(batch_id), mapping=_mapping(update))
            if done:
                pipe.zrem(keys.BATCHES_ACTIVE, batch_id)
            pipe.execute()

    # --- one process at a time per batch ---
    def lock(self, batch_id: str, ttl_ms: int) -> str | None:
        token = secrets.token_hex(8)
        return token if self.redis.set(keys.batch_lock(batch_id), token, nx=True, px=ttl_ms) else None

    def unlock(self, batch_id: str, token: str) -> None:
        self._unlock(keys=[keys.batch_lock(batch_id)], args=[token])

    def renew(self, batch_id: str, token: str, ttl_ms: int) -> None:
        """Hold the lock ``ttl_ms`` more, if it is still this token's."""
        self._renew(keys=[keys.batch_lock(batch_id)], args=[token, ttl_ms])


def redis_job_statuses(client: redis.Redis) -> Callable[[Sequence[str]], list[str | None]]:
    """Each job's status read from its hash in the job store's Redis (one field each, one round trip)."""

    def read(job_ids: Sequence[str]) -> list[str | None]:
        with client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(keys.job(job_id), "status")
            replies = pipe.execute()
        return [r.decode() if isinstance(r, bytes) else r for r in replies]

    return read


def _mapping(fields: dict[str, str]) -> dict[FieldT, EncodableT]:
    """A record's fields as redis-py's hset types its mapping."""
    return {name: value for name, value in fields.items()}


def _metadata(value: object) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs (keys up to 64 characters, values up to 512)."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()):
        raise OpenAIError(400, f"metadata is at most {MAX_METADATA} string pairs (keys up to 64 characters, values "
                          "up to 512)", param="metadata")
    return dict(value)


class BatchDriver:
    """Advances every unsettled batch every ``poll_s``, from a daemon thread (one per results worker)."""

    def __init__(self, batches: Batches, *, poll_s: float, lock_ms: int = 15_000) -> None:
        """``lock_ms``: how long a batch stays locked by a driver that died mid-pass (renewed while one runs)."""
        self.batches = batches
        self.poll_s = poll_s
        self.lock_ms = lock_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_sweep = 0.0

    def run_once(self) -> int:
        """One pass over the active batches; returns how many this process advanced. Once a minute it also
        deletes the bytes of files whose time ran out."""
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + SWEEP_EVERY_S
            try:
                self.batches.files.sweep(time.time())
            except Exception:  # Redis or the store away: the next sweep tries again
                log.warning("batch driver: the file sweep failed", exc_info=True)
        advanced = 0
        for batch_id in members(self.batches.redis.zrange(keys.BATCHES_ACTIVE, 0, 999)):
            token = self.batches.lock(batch_id, self.lock_ms)
            if token is None:
                continue
            try:
                self.batches.advance(batch_id, functools.partial(self.batches.renew, batch_id, token, self.lock_ms))
                advanced += 1
            except Exception:
                log.warning("batch %s: pass failed; retried in %.1fs", batch_id, self.poll_s, exc_info=True)
            finally:
                try:
                    self.batches.unlock(batch_id, token)
                except redis.RedisError:
                    pass  # the lock's TTL frees it
        return advanced

    def start(self) -> BatchDriver:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="omni-batch-driver", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:
                log.warning("batch driver: pass failed", exc_info=True)
            self._stop.wait(self.poll_s)

