"""One Settings object for every process, read from ``OMNI_*`` environment variables.

Every field has a default that works on a single machine with no services configured, so the
embedded demo and the tests need no environment at all; deployments override what they need.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from omni_jobs.core.cpu_lists import parse_cpus
from omni_jobs.core.redis_url import check_redis_url, is_sentinel_url, redact_url

MiB = 1024 * 1024

MallocChoice = Literal["auto", "tcmalloc", "glibc", "system"]
"""The malloc of engine processes (OMNI_ENGINE_MALLOC; omni_jobs.engines.allocator)."""

OPENAI_MODEL_NAMES: tuple[str, ...] = (
    "gpt-4o", "gpt-4o-mini", "gpt-4o-audio-preview", "gpt-4o-mini-audio-preview", "gpt-4o-transcribe",
    "gpt-4o-mini-transcribe", "gpt-4o-mini-tts", "gpt-4.1", "gpt-4.1-mini", "gpt-4.1-nano", "gpt-4-turbo", "gpt-4",
    "gpt-3.5-turbo", "gpt-5", "gpt-5-mini", "gpt-5-nano", "gpt-audio", "gpt-audio-mini", "chatgpt-4o-latest",
    "o1", "o3", "o3-mini", "o4-mini", "dall-e-2", "dall-e-3", "gpt-image-1", "tts-1", "tts-1-hd", "whisper-1",
)
"""OpenAI's model names taken as "choose by what is asked" (the default of OMNI_OPENAI_MODEL_ALIASES)."""

LIST_FORMAT = 'a comma-separated list (a,b) or a JSON list (["a", "b"])'
OBJECT_FORMAT = 'a JSON object (e.g. {"vllm": ">=0.11"})'


def _env_list(value: object) -> object:
    """A list setting as an environment variable gives it: a JSON list, else comma-separated values
    (``OMNI_PIPELINES_PATH=/dir``, ``OMNI_WEBHOOK_ALLOW_HOSTS=127.0.0.1,hooks.internal``), empty ones
    dropped. pydantic-settings took JSON only, and refused a plain value with a 40-line traceback."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text.startswith(("[", "{")):  # an object is JSON too, and refused as such
        return [part.strip() for part in text.split(",") if part.strip()]
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a JSON list ({exc.msg}): give {LIST_FORMAT}") from None
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise ValueError(f"a JSON list of strings is needed: give {LIST_FORMAT}")
    return parsed


def _env_object(value: object) -> object:
    """A JSON object from an environment variable, refused in a sentence naming the format."""
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value) if value.strip() else {}
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"give {OBJECT_FORMAT}")  # noqa: TRY004 (pydantic reports ValueError, not TypeError)
    return parsed


class Settings(BaseSettings):
    """Configuration shared by the API, the workers and the in-process runner."""

    model_config = SettingsConfigDict(env_prefix="OMNI_", env_file=None, extra="ignore")

    # --- Redis: job state, events, small artifacts, and (by default) the Celery broker ---
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for job state and small artifacts.")
    broker_url: str | None = Field(None, description="Celery broker URL; defaults to redis_url.")
    direct_publish: bool = Field(
        True, description="Where the broker is redis_url itself: the commit that makes a step runnable also "
        "pushes its task message onto the Celery queue (one script, no relay hop). false: a relay publishes "
        "through kombu after the commit, as it does for any other broker.")
    redis_wait_replicas: int = Field(
        0, ge=0, description="A submit is answered 202 only once this many Redis replicas have the job (WAIT); "
        "0 relies on the primary's AOF with appendfsync always (docs/reliability.md).")
    redis_wait_aof: bool = Field(
        False, description="A submit is answered 202 only once Redis's AOF has the job on disk (WAITAOF; Redis >= 7.2 "
        "or Valkey, with appendonly yes). Then Redis can run appendfsync everysec: only submits wait for the disk, "
        "every other write answers at once (docs/reliability.md). `omni-jobs up` turns it on where its server "
        "can.")
    redis_wait_timeout_ms: int = Field(1000, gt=0, description="How long a submit waits for those replicas (or "
                                       "the disk) before answering 503.")

    # --- Artifacts ---
    artifact_backend: Literal["local", "s3"] = Field(
        "local", description="Where outputs and large intermediates live: a directory or an S3 bucket."
    )
    artifacts_dir: Path = Field(Path("var/artifacts"), description="Root directory of the local backend.")
    redis_artifact_max_bytes: int = Field(
        1 * MiB, ge=0, description="Intermediates up to this size go to Redis; larger ones to artifact_backend."
    )
    intermediate_ttl_s: int = Field(24 * 3600, gt=0, description="Lifetime of intermediate artifacts.")
    output_ttl_s: int = Field(7 * 24 * 3600, gt=0, description="Lifetime of jobs and their final outputs.")
    cleanup_interval_s: int = Field(3600, gt=0, description="How often beat runs the retention cleanup.")
    s3_bucket: str = Field("omni-jobs", description="Bucket of the s3 backend (created if missing).")
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint (MinIO, moto); None means AWS.")
    s3_public_endpoint_url: str | None = Field(
        None, description="Endpoint that presigned download URLs name, when clients reach S3 at another address."
    )
    s3_region: str = Field("us-east-1", description="S3 region.")
    s3_access_key_id: str | None = Field(None, description="S3 key id; None uses boto3's usual lookup.")
    s3_secret_access_key: SecretStr | None = Field(
        None, description="S3 secret; None uses boto3's usual lookup. Never logged (SecretStr hides it in reprs)."
    )
    s3_prefix: str = Field("", description="Key prefix inside the bucket.")
    output_urls: Literal["presigned", "api"] = Field(
        "presigned", description="Output URLs in job JSON: presigned store URLs where the store has them, or the API."
    )
    s3_max_attempts: int = Field(
        3, ge=1, description="boto3's own tries per S3 call; stage retries (with backoff) come on top of these."
    )
    presign_expires_s: int = Field(3600, gt=0, description="Lifetime of presigned output URLs.")

    # --- Models and pipelines ---
    models_dir: Path = Field(Path("var/models"), description="Where model sources (tiny:) build their local models.")
    model_sources: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["omni_jobs.local.tiny"],
        description="Modules that register model-id sources (e.g. tiny:NAME); a path or hub id needs none "
        "(comma-separated or a JSON list in env).",
    )
    pipelines_path: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Extra pipeline YAML files or directories (comma-separated or a JSON list in env)."
    )

    # --- Engines ---
    ar_kv_cache_bytes: int = Field(256 * MiB, gt=0, description="vLLM KV-cache size per AR engine.")
    ar_max_model_len: int = Field(512, gt=0, description="Default vLLM max_model_len.")
    device: str = Field("auto", description="Torch device for diffusers: auto, cpu, cuda, cuda:N.")
    engine_turns: str = Field(
        "auto", description="Engines of one host's workers take turns at its CPU cores, one step at a time, instead of "
        "slowing each other down: auto (when the engines run on the CPU), off, or the path of the lock file they "
        "share (default /dev/shm/omni-jobs-engine-turns; see omni_jobs.engines.turns).")
    engine_cpus: str = Field(
        "", description="The CPUs this worker's engines run on ('0', '2-3', '0,2'); empty: every CPU. It sets their "
        "thread count and vLLM's binding, and they take turns (engine_turns) only with engines on the same CPUs. "
        "`omni-jobs up --engine-workers N` gives each of N workers per stage its own (omni_jobs.engines.cpu_layout).")
    engine_malloc: MallocChoice = Field(
        "auto", description="The malloc of engine processes (omni_jobs.engines.allocator): auto (tcmalloc where "
        "installed, else glibc's with fixed thresholds: a DiT batch on the CPU faults its activations in again at every "
        "step without either; 1.07x faster tuned, 1.16x with tcmalloc), tcmalloc "
        "(required: `omni-jobs up` refuses to start without it; Debian: apt-get install libtcmalloc-minimal4), "
        "glibc (tuned), system (as the process has it).")
    engine_process: Literal["auto", "on", "off"] = Field(
        "auto", description="Where a stage worker runs its engines: DiT engines in processes of their own, fed over a socket "
        "with arrays in shared memory, which batch its requests themselves (omni_jobs.engines.engine_client), so "
        "that the worker's own Python never holds an engine's interpreter lock; or in the worker's process. auto: "
        "apart where the engine computes on a GPU (and for the benchmark's GPU-shaped engine), in the worker's "
        "process on the CPU, where an engine process costs its own copy of torch and diffusers (~300 MiB a model) "
        "for a few percent. on, off: always, never. Qwen2.5-Omni's code2wav (token2wav) runs apart by the same rule, "
        "its stream's windowing kept in the worker. AR engines likewise run vLLM's core in its engine-core process "
        "(omni_jobs.engines.ar_core), except the Qwen2.5-Omni talker and the pooling encoder, which stay in the "
        "worker's process.")
    preload_engines: bool = Field(True, description="Workers load their stages' engines at start, not on first task.")
    api_gc_young_threshold: int = Field(
        20_000, ge=0, description="The API collects Python's youngest garbage generation once this many more container "
        "objects were made than freed (omni_jobs.core.collector; 0: Python's default, 700). At 700 the collector took ~6% of "
        "the API's CPU: a submit makes ~1,000 such objects, most freed by their reference counts soon after.")
    freeze_engine_objects: bool = Field(
        True, description="Once a worker has preloaded its engines, their objects are frozen out of Python's cyclic "
        "garbage collector (omni_jobs.core.collector): its full passes then walk only the jobs' objects, where "
        "each walked the engines' millions of objects too, holding the interpreter for ~0.2-0.35 s.")

    # --- Worker start-up checks (omni_jobs.dispatch.checks) ---
    version_check: bool = Field(
        True, description="Workers refuse to start when an engine library they need is outside its supported range."
    )
    supported_versions: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description='Override supported version ranges, e.g. {"vllm": ">=0.11"} (JSON in env); at your own risk.',
    )
    refuse_broken_models: Literal["builtin", "all", "none"] = Field(
        "builtin",
        description="While preloading, a model that cannot load stops the worker: 'builtin' for the built-in "
        "catalogue's pipelines only (a user pipeline's broken model fails its jobs instead), 'all', or 'none'.",
    )

    # --- Observability ---
    log_format: Literal["json", "text"] = Field("json", description="Log lines: JSON objects (job_id, stage, "
                                                "task_id fields) or plain text.")
    log_level: str = Field("INFO", description="Log level of the API (workers take Celery's --loglevel).")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Workers serve Prometheus metrics on this port; 0 = off (the API serves /metrics)."
    )
    metrics_token: SecretStr | None = Field(
        None, description="A scrape token: once set, the API's /metrics answers only `Authorization: Bearer <token>` "
        "(401 otherwise), and /readyz shows its details (worker names, service addresses) only to it. Without it, "
        "/metrics stays open and neither names a tenant or a host. Never logged.")

    # --- Queues ---
    visibility_timeout_s: int = Field(
        3600, gt=0, description="A step sent to its queue and not started after this long is sent again even while "
        "the queue has a backlog (its message was lost with a dead worker); with an empty queue, dispatch_timeout_s."
    )
    stage_soft_time_limit_s: float = Field(
        600, gt=0, description="A stage running longer fails its job at its next step/token (per-stage override)."
    )
    stage_time_limit_s: float = Field(
        900, gt=0, description="Hard limit: the job fails and the worker process is replaced (per-stage override)."
    )
    progress_interval_s: float = Field(
        0.2, ge=0, description="Least time between two progress writes of a stage while a reader looks at its job "
        "(an SSE stream, a GET of the running job, a cancel: omni_jobs.jobs.followed).")
    progress_unfollowed_interval_s: float = Field(
        1.0, ge=0, description="Least time between two progress writes of a stage whose job nobody looks at (its "
        "list entry and `progress` webhooks move at this pace), counted from its first step: a stage shorter than this "
        "writes none. While a reader looks, the first and the last step are always written.")
    text_deltas: Literal["followed", "always"] = Field(
        "followed", description="When a running text stage publishes its output.delta events: 'followed', while "
        "a reader follows the job's events live (else its text goes out as the stage ends); 'always'."
    )
    text_delta_interval_ms: float = Field(
        50.0, gt=0, description="Least time between two output.delta events of one streamed text output (a worker "
        "on CPU cores, whose engine steps are slower than this, may raise it: fewer events, fewer writes)."
    )
    batch_max_size: int = Field(16, ge=1, description="Largest engine batch a stage worker makes (per-stage override).")
    batch_wait_ms: float = Field(
        10.0, ge=0, description="How long the first request of a batch waits for batch-mates (per-stage override)."
    )
    batch_fill_wait_ms: float = Field(
        50.0, ge=0, description="How much longer a batch with room left waits while more work for its worker is on "
        "its way (received tasks, queued messages with free slots); it starts at once when nothing is coming.")
    batch_burst_fill: float = Field(
        0.2, ge=0, le=1, description="DiT stages: the most a batch with room left waits for a burst of requests "
        "still arriving, as a fraction of its kind's longest recent batch run (a running DiT batch takes no newcomers; "
        "it waits only while each newcomer pays for its wait, see omni_jobs.engines.batching). 0: never.")
    batch_idle_release_s: float = Field(
        1.0, ge=0, description="How long an engine's batcher thread waits without work before it hands back its "
        "OpenMP team (CPU engines: an idle engine's helper threads slow every other engine of the worker); 0: never.")
    worker_switch_interval_ms: float = Field(
        5.0, gt=0, description="The Python interpreter's thread switch interval in worker processes (Python's "
        "own default, 5 ms): how long an engine thread back from a torch op may wait for the GIL while the "
        "worker's other threads (Celery's consumer, tasks recording results, the writers) hold it. Shorter "
        "hands the GIL back sooner, at the cost of more forced switches (docs/decisions/switch-interval.md).")
    worker_handoff_ms: float = Field(
        0.2, ge=0, le=5, description="How long a worker's Celery consumer pauses after handing a task to its "
        "thread, so that the task's thread takes the interpreter at once and starts the step (workers/celery_patches.py; "
        "0: no pause).")
    worker_task_events: bool = Field(
        False, description="Workers send Celery's task events (received, started, succeeded: what Flower shows) "
        "from their start. Off, they send them only once a monitor asks: Flower does within 5 s of its start and "
        "every 5 s after (`celery control enable_events` too), so Flower sees every task from then on. Off saves "
        "the workers ~2% of their throughput while nobody watches (docs/decisions/task-events-off.md).")
    stage_max_in_flight: int = Field(
        16, ge=1, description="Tasks one AR/DiT worker process runs at once (its threads; per-stage override)."
    )
    stage_cache_max_entries: int = Field(1000, ge=1, description="Entries of the stage-output cache per stage.")
    stage_cache_eviction: Literal["fifo", "lru"] = Field("lru", description="Which entry a full stage-output cache drops.")
    stage_max_retries: int = Field(
        5, ge=0, description="Retries of a stage (or the results step) after a transient error or a lost worker; "
        "then its job fails.")
    stage_retry_backoff_s: float = Field(1.0, gt=0, description="First retry delay; doubles each retry, with jitter.")

    # --- Job state: leases, the reaper, the outbox relay (docs/reliability.md) ---
    lease_s: float = Field(
        15, gt=0, description="A running step's lease: renewed every third of it while its worker lives; when it "
        "expires (the worker was killed), the reaper queues the step's next attempt.")
    reaper_interval_s: float = Field(2, gt=0, description="How often a worker runs the reaper (one pass at a time "
                                     "across all processes).")
    dispatch_timeout_s: float = Field(
        20, gt=0, description="A step still waiting this long while its queue is empty is published again (its "
        "message was lost, or held by a worker that died before starting it).")
    results_inline: bool = Field(
        True, description="The worker whose stage completes a job writes its final outputs at once (no hop through "
        "the results queue). Turn off where stage workers cannot reach the output store; results workers then do it.")
    outbox_poll_s: float = Field(0.5, gt=0, description="How often a relay looks for due outbox entries besides "
                                 "being woken by its own process's commits, while its looks find work.")
    outbox_idle_poll_s: float = Field(
        4.0, gt=0, description="The longest a relay waits between looks that find nothing (each empty look doubles "
        "the wait from OMNI_OUTBOX_POLL_S). It also wakes when the outbox's next entry comes due (a retry's backoff) "
        "and after its own process's commits; an idle process wakes Redis ~0.3 times a second for it instead of 2.")
    store_wait_s: float = Field(
        600, gt=0, description="How long a worker waits for an unreachable job store before giving up on a step "
        "(the step comes back through the reaper once Redis answers).")
    run_journal: Path | None = Field(
        None, description="Append one JSON line per engine run to this file (audits; the chaos test counts runs).")

    # --- Scheduling (docs/scaling.md) ---
    priority_aging_s: float = Field(
        300, ge=0, description="A high job's stages go this far ahead of its tenant's normal work queued before "
        "them; a low job's are passed by normal work queued at most this long after them (no starvation).")
    scheduler_slack: int = Field(
        2, ge=0, description="Stages released to a queue beyond its live workers' concurrency, so that a freed "
        "slot finds its next task waiting. Small: tenants take turns only among what is not released yet.")
    tenant_max_active: int = Field(
        0, ge=0, description="Default limit of a tenant's jobs queued or running at once (0: none); per tenant or "
        "API key with `omni-jobs keys limits`. A breach answers 429 with Retry-After.")
    tenant_jobs_per_minute: int = Field(
        0, ge=0, description="Default limit of a tenant's submissions per minute (0: none); per tenant or key too.")

    max_queued_per_queue: int = Field(
        1000, ge=1, description="New jobs are refused (503 + Retry-After) while their first queue holds this many."
    )
    overload_retry_after_s: int = Field(10, ge=1, description="Retry-After sent with an overload 503.")
    idempotency_ttl_s: int = Field(24 * 3600, gt=0, description="How long an Idempotency-Key is remembered.")
    max_cancel_after_s: float = Field(7 * 24 * 3600, gt=0, description="Longest Cancel-After a job may ask for.")

    # --- Batches and files (OpenAI's Batch API: omni_jobs.accept.files, omni_jobs.accept.batches) ---
    batch_file_max_bytes: int = Field(
        32 * MiB, gt=0, description="Largest file POST /v1/files takes (purpose=batch); the upload is also held to "
        "OMNI_MAX_REQUEST_BYTES.")
    batch_file_max_lines: int = Field(50_000, gt=0, description="Most request lines one batch file may hold.")
    batch_max_in_flight: int = Field(
        8, ge=1, description="Lines of one batch submitted as jobs and not yet ended, at most: a batch's Redis "
        "footprint stays this many jobs, whatever its size (the rest wait in the file), and the engines' batches "
        "leave room for interactive jobs (bench.batches: 8 kept a chat's p50 within 1.25x on 2 CPU cores, 256 made "
        "it 3.5x). Raise it for batch throughput where engines batch cheaply (GPUs).")
    batch_poll_s: float = Field(0.25, gt=0, description="How often a results worker advances the running batches.")
    batch_file_ttl_s: int = Field(30 * 24 * 3600, gt=0, description="Lifetime of uploaded and output files.")
    admin_tenants: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Tenants whose API keys see every tenant's usage (GET /v1/usage), "
        "comma-separated or a JSON list in env; any other key sees its own tenant's.")

    # --- API ---
    public_url: str = Field("http://127.0.0.1:8000", description="Base URL clients use to reach the API.")
    max_page_size: int = Field(100, gt=0, description="Largest page GET /v1/jobs returns.")
    openai_wait_s: float = Field(
        600, gt=0, description="Longest an OpenAI-compatible call waits for its job before answering 504 (job id given)."
    )
    openai_model_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(OPENAI_MODEL_NAMES),
        description="Model names the OpenAI-compatible routes take besides the pipelines' (default OpenAI's own: "
        "gpt-4o, dall-e-3, tts-1, whisper-1...): the pipeline is then chosen by what is asked. Any other name is "
        "answered 404 model_not_found (comma-separated or a JSON list in env).",
    )
    max_prefer_wait_s: float = Field(
        60, ge=0, description="Cap on `Prefer: wait=N` for POST /v1/jobs (seconds the request may block)."
    )
    max_streams_per_tenant: int = Field(
        100, ge=1, description="Long requests (SSE event streams, the console's live pages, `Prefer: wait`) one "
        "tenant may hold open at once in one API process; past it a stream is answered 429 (Retry-After), and a "
        "`Prefer: wait` submit at once, without waiting. Each holds a Redis connection while it blocks.")
    max_streams: int = Field(
        1000, ge=1, description="Long requests all tenants together may hold open in one API process; past it a "
        "stream is answered 503 (Retry-After). Their Redis connections come from a pool of their own of this "
        "size (plus a few for reads), so streams cannot take the connections that submits use, nor fill Redis's "
        "maxclients, which the workers need.")

    # --- Security (docs/operations/security.md) ---
    auth_enabled: bool = Field(
        True, description="Require `Authorization: Bearer <API key>` on /v1 routes. Only the embedded demo or a "
        "test may turn it off, explicitly; the API then logs a warning at start and every job is tenant 'default'.",
    )
    max_request_bytes: int = Field(32 * MiB, gt=0, description="Largest request body (413 above it).")
    max_prompt_chars: int = Field(20000, gt=0, description="Longest text input of a job (on top of each pipeline's max_length).")
    max_image_bytes: int = Field(16 * MiB, gt=0, description="Largest image input (encoded bytes).")
    max_image_pixels: int = Field(4096 * 4096, gt=0, description="Largest image input, width x height, checked before decoding.")
    max_audio_bytes: int = Field(25 * MiB, gt=0, description="Largest audio input (encoded bytes).")
    max_audio_seconds: float = Field(
        600, gt=0, description="Longest audio input: its declared length is checked before decoding, what decodes "
        "is counted too.",
    )
    max_video_bytes: int = Field(
        64 * MiB, gt=0, description="Largest video input (encoded bytes; an upload is also held to OMNI_MAX_REQUEST_BYTES).",
    )
    max_video_seconds: float = Field(120, gt=0, description="Longest video input (declared, then counted as it decodes).")
    max_video_frames: int = Field(1800, gt=0, description="Most frames a video input may have (declared, then counted).")
    max_video_pixels: int = Field(1920 * 1080, gt=0, description="Largest frame of a video input, width x height.")
    max_steps: int = Field(200, gt=0, description="Most diffusion steps a job may ask for (num_inference_steps).")
    max_image_side: int = Field(2048, ge=16, description="Largest width or height a job may ask for, in pixels.")
    max_tokens: int = Field(4096, gt=0, description="Most tokens an AR stage may be asked to generate (max_tokens).")
    max_outputs: int = Field(10, gt=0, description="Most images one OpenAI images call may ask for (n).")
    webhook_allow_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Webhook hosts (`host` or `host:port`, comma-separated or a JSON list in env) that may resolve "
        "to private, loopback or link-local addresses and may use http://. Everything else must be https:// to a "
        "public address.",
    )

    # --- Webhooks (Standard Webhooks; schedule documented in docs/api/webhooks.md) ---
    webhook_secret: SecretStr | None = Field(
        None,
        description="Signing secret(s) `whsec_<base64>`, comma-separated during rotation (one signature each). "
        "Without one, jobs that ask for a webhook are refused (422); a malformed one stops the API at start. "
        "Never logged.",
    )
    webhook_timeout_s: float = Field(10, gt=0, description="Timeout of one webhook POST (connect + response).")
    webhook_max_attempts: int = Field(10, ge=1, description="Attempts of a `completed` webhook before giving up.")
    webhook_retry_base_s: float = Field(5, gt=0, description="Delay before the 2nd attempt; doubles each retry.")
    webhook_retry_max_s: float = Field(
        1800, gt=0, description="Longest delay between attempts (also caps Retry-After)."
    )
    webhook_retry_jitter: float = Field(0.25, ge=0, le=1, description="Each delay is scaled by 1 +/- this, at random.")
    webhook_progress_interval_s: float = Field(
        2, ge=0, description="Least time between two `progress` webhooks of one job (stage ends always send one)."
    )
    webhook_deliveries_kept: int = Field(100, ge=1, description="Latest delivery attempts kept on the job.")

    @field_validator("model_sources", "pipelines_path", "webhook_allow_hosts", "openai_model_aliases", "admin_tenants",
                     mode="before")
    @classmethod
    def _list_from_env(cls, value: object) -> object:
        return _env_list(value)

    @field_validator("supported_versions", mode="before")
    @classmethod
    def _object_from_env(cls, value: object) -> object:
        return _env_object(value)

    @field_validator("webhook_secret", "metrics_token", mode="before")
    @classmethod
    def _empty_secret_is_none(cls, value: object) -> object:
        """An empty OMNI_WEBHOOK_SECRET (as compose passes an unset one) means: no webhooks; an empty
        OMNI_METRICS_TOKEN, no token."""
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("redis_url", "broker_url")
    @classmethod
    def _redis_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A malformed sentinel:// URL is named at start, in one line with the format (omni_jobs.core.redis_url);
        the broker may be another kombu transport (amqp://)."""
        if value is None or (info.field_name == "broker_url" and not is_sentinel_url(value)):
            return value
        return check_redis_url(value, f"OMNI_{str(info.field_name).upper()}")

    @field_validator("engine_cpus")
    @classmethod
    def _cpu_list(cls, value: str) -> str:
        """A typo in OMNI_ENGINE_CPUS is named at start, not found later in vLLM's binding."""
        if value.strip():
            parse_cpus(value)
        return value.replace(" ", "")

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def publishes_in_commit(self) -> bool:
        """Whether commits push task messages onto the broker themselves (``direct_publish``)."""
        return self.direct_publish and self.effective_broker_url == self.redis_url


class SettingsInvalid(SystemExit):
    """Settings the environment gave that do not parse: one line per variable, naming it, its value
    and what it takes. A SystemExit, so that a process (uvicorn importing the API, a Celery worker, the
    CLI) stops with those lines and no traceback."""


def _invalid_line(error: dict[str, object]) -> str:
    loc = error.get("loc") or ("?",)
    assert isinstance(loc, tuple)
    field = str(loc[0])
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    if field in ("model_sources", "pipelines_path", "webhook_allow_hosts", "openai_model_aliases") \
            and LIST_FORMAT not in message:
        message = f"{message}: give {LIST_FORMAT}"
    value = error.get("input")
    shown = value if isinstance(value, str) else json.dumps(value, default=str)
    if field in ("redis_url", "broker_url"):  # it may hold a password
        shown = redact_url(shown)
    return f"OMNI_{field.upper()}={shown!r}: {message}"


def load_settings() -> Settings:
    """Settings from the environment; SettingsInvalid (one line per bad variable) instead of pydantic's
    traceback."""
    try:
        return Settings()
    except ValidationError as exc:
        raise SettingsInvalid("\n".join(_invalid_line(dict(e)) for e in exc.errors(include_url=False))) from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (tests build their own Settings instead)."""
    return load_settings()
