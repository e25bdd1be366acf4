"""Every Redis key and artifact path omni-jobs uses, in one place (as arq does).

Nothing else builds a key by hand, so a reader can see the whole data layout here and a
renamed key cannot drift between the API and the workers.
"""

from __future__ import annotations

PREFIX = "omni"

# --- jobs (omni_jobs.jobs: every key of one job expires with it) ---
def job(job_id: str) -> str:
    """Hash of one job: its fields, one field per stage attribute (``stage:<id>:status``, ...) and the
    results step's (``results:status``, ...); a transition writes only the fields it changes."""
    return f"{PREFIX}:job:{job_id}"


def job_events(job_id: str) -> str:
    """Redis stream of the job's events (status changes, progress), read by SSE."""
    return f"{PREFIX}:job:{job_id}:events"


def job_progress(job_id: str) -> str:
    """JSON {stage, step, total, unit} of the running stage: written often, so apart from the job hash."""
    return f"{PREFIX}:job:{job_id}:progress"


def job_followed(job_id: str) -> str:
    """Present (with a short TTL) while somebody looks at the job, and how: ``stream`` while a reader
    follows its events live (its running text stages publish their deltas as they come, not only
    when they end), ``look`` after a GET of it not yet ended or a cancel (its running stages write
    their progress often). omni_jobs.jobs.followed, omni_jobs.jobs.watch."""
    return f"{PREFIX}:job:{job_id}:followed"


def job_webhooks(job_id: str) -> str:
    """Hash of the job's webhook messages: ``<message id>:<field>`` (event, status, attempts, lease)."""
    return f"{PREFIX}:job:{job_id}:webhooks"


def job_deliveries(job_id: str) -> str:
    """List of the job's webhook delivery attempts (JSON), newest last, capped."""
    return f"{PREFIX}:job:{job_id}:deliveries"


JOBS_INDEX = f"{PREFIX}:jobs"
"""Sorted set of every job id, scored by creation time (for listing)."""


def jobs_by_status(status: str, tenant: str | None = None) -> str:
    """Sorted set of the job ids in one status (all, or one tenant's), scored by creation time: a
    list filtered by status reads only its page, however many jobs are kept."""
    return f"{PREFIX}:jobs:{status}" if tenant is None else f"{PREFIX}:tenant:{tenant}:jobs:{status}"


DEADLINES = f"{PREFIX}:deadlines"
"""Sorted set of unfinished jobs that have a deadline (Cancel-After), scored by it: retention finds
the overdue ones without reading every job."""


def job_artifacts(job_id: str) -> str:
    """Set of the artifact keys a job keeps in Redis: deleting them needs no keyspace SCAN."""
    return f"{PREFIX}:job:{job_id}:artifacts"


# --- the outbox, leases and the reaper (omni_jobs.dispatch.outbox, omni_jobs.dispatch.leases) ---
OUTBOX = f"{PREFIX}:outbox"
"""Sorted set of outbox entry ids (steps to publish), scored by when they are due (or held until)."""

OUTBOX_ITEMS = f"{PREFIX}:outbox:items"
"""Hash: outbox entry id -> the step as JSON."""

LEASES = f"{PREFIX}:leases"
"""Sorted set of leased step slots (``stage:<job>:<stage>``, ``results:<job>``, ``webhook:<job>:<msg>``),
scored by when the lease expires: what the reaper reads."""

REAPER_LOCK = f"{PREFIX}:reaper:lock"
"""SET NX PX lock: one reaper pass at a time across all processes."""


RETENTION_MARK = f"{PREFIX}:retention:intermediates-mark"
"""Creation time up to which jobs' intermediates were already cleaned (a high-water mark)."""


def idempotency(tenant: str, key: str) -> str:
    """Hash {job_id, fingerprint} binding a tenant's Idempotency-Key to the job it created."""
    return f"{PREFIX}:idempotency:{tenant}:{key}"


# --- artifacts ---
def artifact(key: str) -> str:
    """Bytes of an artifact kept by the redis backend."""
    return f"{PREFIX}:artifact:{key}"


def job_artifact_prefix(job_id: str) -> str:
    """Artifact-key prefix of everything one job wrote (any backend)."""
    return f"jobs/{job_id}/"


def job_intermediates_prefix(job_id: str) -> str:
    """Artifact-key prefix of everything a job's stages handed each other."""
    return f"jobs/{job_id}/stages/"


def intermediate_artifact(job_id: str, stage_id: str, name: str, attempt: int | None = None) -> str:
    """Artifact key of an intermediate a stage hands to the next one; each attempt writes its own,
    so a stale attempt finishing late never overwrites what a newer one recorded."""
    if attempt is None:
        return f"jobs/{job_id}/stages/{stage_id}/{name}"
    return f"jobs/{job_id}/stages/{stage_id}/attempt-{attempt}/{name}"


def output_artifact(job_id: str, filename: str, writer: str | None = None) -> str:
    """Artifact key of a final output file; ``writer``: the attempt that writes it, when not the
    first attempt of the last stage (omni_jobs.report.results.writer_of): each writer has keys of its own."""
    return f"jobs/{job_id}/outputs/{writer}/{filename}" if writer else f"jobs/{job_id}/outputs/{filename}"


def input_artifact(job_id: str, name: str) -> str:
    """Artifact key of a file that came with the job's input."""
    return f"jobs/{job_id}/inputs/{name}"


# --- workers ---
WORKERS = f"{PREFIX}:workers"
"""Hash: worker name -> JSON {name, queues, concurrency, pid, expires_at}, refreshed while it lives
(one HGETALL lists them all, whatever the size of the keyspace)."""


def ui_session(digest: str) -> str:
    """Hash: a console session (omni_jobs.accept.auth.ConsoleSessions) by the SHA-256 of its cookie: the API key
    id and tenant it signed in with; its TTL is the session's life, and signing out deletes it."""
    return f"{PREFIX}:ui:session:{digest}"


def worker_node(name: str) -> str:
    """String: the process that holds a worker node name, JSON {host, pid, token}, with a TTL its
    heartbeat renews (omni_jobs.dispatch.worker_registry.claim_node): one live process per name."""
    return f"{PREFIX}:node:{name}"


# --- the Celery broker (kombu's Redis transport), read for queue depth ---
KOMBU_PRIORITY_SEPARATOR = "\x06\x16"
KOMBU_PRIORITY_STEPS = (0, 3, 6, 9)


def broker_queue_lists(queue: str) -> list[str]:
    """The Redis lists that hold a queue's waiting messages (one per kombu priority step)."""
    return [queue if p == 0 else f"{queue}{KOMBU_PRIORITY_SEPARATOR}{p}" for p in KOMBU_PRIORITY_STEPS]


# --- queues: what waits and what runs, per queue (positions, metrics, the dispatch watchdog) ---
def queue_waiting(queue: str) -> str:
    """Sorted set of step slots queued on one queue, scored by when they became runnable."""
    return f"{PREFIX}:queue:{queue}:waiting"


def queue_running(queue: str) -> str:
    """Sorted set of step slots running on one queue (holding a lease), scored by start time."""
    return f"{PREFIX}:queue:{queue}:running"


def queue_released(queue: str) -> str:
    """Sorted set of step slots the scheduler released to the broker and no worker started yet."""
    return f"{PREFIX}:queue:{queue}:released"


def queue_ready(queue: str, tenant: str) -> str:
    """Sorted set of a tenant's first dispatches waiting for the scheduler on one queue: outbox
    entry ids, scored by their order (queued time, moved by priority)."""
    return f"{PREFIX}:queue:{queue}:ready:{tenant}"


def queue_tenants(queue: str) -> str:
    """Sorted set of the tenants with ready work on one queue, scored by when each was last served
    (the scheduler serves the one served longest ago: round robin)."""
    return f"{PREFIX}:queue:{queue}:tenants"


SCHEDULED_QUEUES = f"{PREFIX}:scheduler:queues"
"""Set of the queues that have had scheduled work (the relays' release passes go over them)."""


def throttle(name: str) -> str:
    """SET NX PX marker of a throttle (e.g. one progress webhook per job per interval)."""
    return f"{PREFIX}:throttle:{name}"



# --- API keys and tenants (omni_jobs.accept.auth) ---
def api_key(key_id: str) -> str:
    """Hash {id, tenant, name, hash, created_at, revoked} of one API key; the key itself is never stored."""
    return f"{PREFIX}:apikey:{key_id}"


API_KEYS_INDEX = f"{PREFIX}:apikeys"
"""Sorted set of every API key id, scored by creation time (for `omni-jobs keys list`)."""


def tenant_jobs(tenant: str) -> str:
    """Sorted set of one tenant's job ids, scored by creation time (written with JOBS_INDEX)."""
    return f"{PREFIX}:tenant:{tenant}:jobs"


def tenant_active(tenant: str) -> str:
    """Sorted set of a tenant's jobs not finished yet (queued or running), scored by creation time."""
    return f"{PREFIX}:tenant:{tenant}:active"


def tenant_submits(tenant: str) -> str:
    """Sorted set of a tenant's recent submissions (job ids, scored by time): its jobs per minute."""
    return f"{PREFIX}:tenant:{tenant}:submits"


def tenant_limits(tenant: str) -> str:
    """Hash {max_active, per_minute} of one tenant's quotas (absent: the defaults of the settings)."""
    return f"{PREFIX}:tenant:{tenant}:limits"


# --- the stage-output cache (omni_jobs.run.stage_cache) ---
def stage_cache_entry(scope: str, digest: str) -> str:
    """Hash of one cached stage result: output port -> bytes, plus ``__media__`` (JSON port -> media type)."""
    return f"{PREFIX}:stage-cache:{scope}:entry:{digest}"


def stage_cache_index(scope: str) -> str:
    """Sorted set of the scope's cached digests, scored by insertion (fifo) or last use (lru) order."""
    return f"{PREFIX}:stage-cache:{scope}:index"


STAGE_CACHE_CLOCK = f"{PREFIX}:stage-cache:clock"
"""INCR counter ordering stage-cache insertions and uses (ties of wall-clock times would blur lru/fifo)."""


# --- files and batches (omni_jobs.accept.files, omni_jobs.accept.batches: OpenAI's Batch API) ---
def file(file_id: str) -> str:
    """Hash of one uploaded or produced file's record (tenant, purpose, filename, bytes, lines, artifact ref);
    the bytes are in the artifact store, never here."""
    return f"{PREFIX}:file:{file_id}"


def tenant_files(tenant: str) -> str:
    """Sorted set of a tenant's file ids, scored by creation time."""
    return f"{PREFIX}:tenant:{tenant}:files"


def file_artifact(file_id: str) -> str:
    """Artifact key of a file's bytes (the large backend: local or S3)."""
    return f"files/{file_id}/content.jsonl"


def batch(batch_id: str) -> str:
    """Hash of one batch: its OpenAI fields, its cursor (next line to submit) and its counts."""
    return f"{PREFIX}:batch:{batch_id}"


def batch_lines(batch_id: str) -> str:
    """Hash: line index -> the job id(s) it made (comma-separated), or ``!`` + the JSON error that refused it."""
    return f"{PREFIX}:batch:{batch_id}:lines"


def batch_pending(batch_id: str) -> str:
    """Set of the line indexes whose jobs are not ended yet (at most OMNI_BATCH_MAX_IN_FLIGHT)."""
    return f"{PREFIX}:batch:{batch_id}:pending"


def batch_lock(batch_id: str) -> str:
    """SET NX PX lock: one process advances a batch at a time."""
    return f"{PREFIX}:batch:{batch_id}:lock"


def tenant_batches(tenant: str) -> str:
    """Sorted set of a tenant's batch ids, scored by creation time."""
    return f"{PREFIX}:tenant:{tenant}:batches"


BATCHES_ACTIVE = f"{PREFIX}:batches:active"
"""Sorted set of the batches not settled yet (running, or a webhook still to send), scored by creation."""


# --- usage per tenant (omni_jobs.report.usage) ---
def usage(tenant: str, day: str) -> str:
    """Hash of one tenant's usage on one UTC day (``YYYY-MM-DD``): ``jobs:<status>``, ``stage_seconds:<queue>``,
    ``tokens_in``, ``tokens_out``, ``images``, ``audio_seconds``, ``video_frames`` (HINCRBYFLOAT)."""
    return f"{PREFIX}:usage:{tenant}:{day}"


USAGE_TENANTS = f"{PREFIX}:usage:tenants"
"""Set of the tenants that have usage recorded (what an admin's GET /v1/usage reads)."""


FILES_EXPIRING = f"{PREFIX}:files:expiring"
"""Sorted set of file ids scored by when they expire: the batch driver deletes their bytes then
(omni_jobs.accept.files.FileStore.sweep), as the record's TTL deletes the record."""
