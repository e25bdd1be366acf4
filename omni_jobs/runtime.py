"""Wiring: build every core component from one Settings, for the API, the workers and tests.

Components are made lazily and once per process, so the API never loads an engine and a worker
loads only the engines its tasks ask for. The transport is given by the shell (``publish``): the
core never imports Celery.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from functools import partial

from redis import Redis

from omni_jobs.accept.batch_lines import LinePlanner
from omni_jobs.accept.batch_results import Shaping
from omni_jobs.accept.batches import BatchDriver, Batches, BatchWebhook, redis_job_statuses
from omni_jobs.accept.files import DurableRecords, FileStore
from omni_jobs.accept.submission import Admission, JobSubmitter
from omni_jobs.artifacts import ArtifactStore, artifact_store_from_settings
from omni_jobs.core.net_guard import NetGuard
from omni_jobs.core.once import once_property
from omni_jobs.core.redis_clients import async_client_from_url, redis_client
from omni_jobs.core.redis_replies import text_hash
from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.leases import LeaseKeeper, Reaper, lease_owner
from omni_jobs.dispatch.outbox import OutboxRelay, Publish
from omni_jobs.dispatch.queue_depth import queue_depth
from omni_jobs.dispatch.queueing import broker_message_templates
from omni_jobs.dispatch.scheduling import QuotaDefaults, Quotas, Scheduler
from omni_jobs.dispatch.worker_registry import queue_capacity
from omni_jobs.engines import turns
from omni_jobs.engines.batching import BatchDefaults
from omni_jobs.engines.pool import EnginePool
from omni_jobs.executor import StepExecutor
from omni_jobs.jobs import commit_listeners
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import Job
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import RESULTS_QUEUE, WEBHOOKS_QUEUE
from omni_jobs.jobs.view import JobJSON, output_url, present_job
from omni_jobs.jobs.watch import job_readers
from omni_jobs.pipelines.catalogue import PipelineCatalogue, load_catalogue
from omni_jobs.pipelines.limits import Limits
from omni_jobs.report.results import ResultsAssembler
from omni_jobs.report.webhooks import RetryPolicy, WebhookDeliverer, WebhookSigner
from omni_jobs.run.run_journal import RunJournal
from omni_jobs.run.stage_attempt import Retries, StageLimits
from omni_jobs.run.stage_outputs import StageCaches
from omni_jobs.run.stage_reports import Reporting
from omni_jobs.run.stages import StageRunner


class Runtime:
    def __init__(self, settings: Settings, *, worker: str | None = None, hard_time_limits: bool = False) -> None:
        """``worker``: this process's worker name (Celery's node name, e.g. ``dit@host``).
        ``hard_time_limits``: a stage past its hard time limit ends this process (worker processes)."""
        self.settings = settings
        self.hard_time_limits = hard_time_limits
        self.worker = worker or socket.gethostname()
        self._owner: tuple[int, str] | None = None
        self._relay: OutboxRelay | None = None

    @property
    def owner(self) -> str:
        """This process's lease owner token (made again in a forked child: each process owns its own)."""
        if self._owner is None or self._owner[0] != os.getpid():
            self._owner = (os.getpid(), lease_owner(self.worker))
        return self._owner[1]

    def set_worker(self, name: str) -> None:
        self.worker = name
        self._owner = None

    @once_property
    def redis(self) -> Redis:
        return redis_client(self.settings.redis_url, health_check_interval=30)

    @once_property
    def store(self) -> RedisJobStore:
        s = self.settings
        # Retention deletes a job (and its queue and outbox entries) once it is OMNI_OUTPUT_TTL_S old;
        # its keys expire a day later by themselves, should no cleanup run.
        store = RedisJobStore(self.redis, ttl_s=s.output_ttl_s + 24 * 3600, wait_replicas=s.redis_wait_replicas,
                              wait_timeout_ms=s.redis_wait_timeout_ms, wait_aof=s.redis_wait_aof,
                              broker_templates=broker_message_templates() if s.publishes_in_commit else None)
        url = s.redis_url  # the a* methods' client: the same URL (Sentinels, TLS and all)
        store.use_async_client(lambda: async_client_from_url(url))
        if s.publishes_in_commit:  # the broker is this Redis: a commit runs the scheduler's pass and publishes
            store.publish_in_commit(lambda change: self.scheduler.windows_for(change))
        return store

    @once_property
    def ledger(self) -> JobLedger:
        s = self.settings
        policy = RetryPolicy.from_settings(s)
        ledger = JobLedger(self.store, lease_s=s.lease_s, max_attempts=1 + s.stage_max_retries,
                           webhook_progress_interval_s=s.webhook_progress_interval_s,
                           webhook_attempts=policy.attempts_for, deliveries_kept=s.webhook_deliveries_kept,
                           priority_aging_s=s.priority_aging_s)
        ledger.listeners.append(commit_listeners.committed)  # job and stage metrics, where a shell installed them
        return ledger

    @property
    def jobs(self) -> JobLedger:
        """Reading and changing jobs (the name the API routes use)."""
        return self.ledger

    @once_property
    def catalogue(self) -> PipelineCatalogue:
        return load_catalogue(self.settings.pipelines_path)

    @once_property
    def artifacts(self) -> ArtifactStore:
        return artifact_store_from_settings(self.settings, redis_client=self.redis)

    @once_property
    def engines(self) -> EnginePool:
        s = self.settings
        turns.configure(turns.lock_file(s.engine_turns, s.device, s.engine_cpus))  # engines on shared CPU cores take turns
        return EnginePool(s.models_dir, kv_cache_bytes=s.ar_kv_cache_bytes, max_model_len=s.ar_max_model_len,
                           device=s.device, engine_process=s.engine_process)

    @once_property
    def keeper(self) -> LeaseKeeper:
        return LeaseKeeper(self.ledger, every_s=self.settings.lease_s / 3)

    @once_property
    def stage_runner(self) -> StageRunner:
        s = self.settings
        limits = StageLimits(soft_time_limit_s=s.stage_soft_time_limit_s, time_limit_s=s.stage_time_limit_s,
                             watchdog=self.hard_time_limits)
        reporting = Reporting(progress_interval_s=s.progress_interval_s,
                              progress_unfollowed_interval_s=s.progress_unfollowed_interval_s,
                              text_delta_interval_s=s.text_delta_interval_ms / 1000, text_deltas=s.text_deltas,
                              followed=partial(job_readers, self.redis))
        batching = BatchDefaults(max_batch_size=s.batch_max_size, wait_ms=s.batch_wait_ms,
                                 max_in_flight=s.stage_max_in_flight, idle_release_s=s.batch_idle_release_s,
                                 burst_fill=s.batch_burst_fill)
        return StageRunner(ledger=self.ledger, catalogue=self.catalogue, artifacts=self.artifacts,
                           engines=self.engines, limits=limits, reporting=reporting,
                           retries=Retries(backoff_s=s.stage_retry_backoff_s, store_wait_s=s.store_wait_s),
                           batching=batching, keeper=self.keeper,
                           caches=StageCaches(self.redis, max_entries=s.stage_cache_max_entries,
                                              eviction=s.stage_cache_eviction),
                           run_journal=RunJournal(s.run_journal) if s.run_journal else None,
                           assemble_results=self.results if s.results_inline else None)

    @once_property
    def results(self) -> ResultsAssembler:
        s = self.settings
        return ResultsAssembler(ledger=self.ledger, catalogue=self.catalogue, artifacts=self.artifacts,
                                keeper=self.keeper,
                                retries=Retries(backoff_s=s.stage_retry_backoff_s, store_wait_s=s.store_wait_s))

    @once_property
    def executor(self) -> StepExecutor:
        return StepExecutor(self.stage_runner, self.results, self.webhooks)

    def relay(self, publish: Publish) -> OutboxRelay:
        """This process's outbox relay (one per process), woken by every commit that dispatches."""
        if self._relay is None:
            self._relay = OutboxRelay(self.store, publish, poll_s=self.settings.outbox_poll_s,
                                      idle_poll_s=self.settings.outbox_idle_poll_s, scheduler=self.scheduler)
            self.ledger.outbox_listeners.append(self._relay.wake)
        return self._relay

    def queues(self) -> Iterable[str]:
        """Every queue a step of this catalogue can wait on."""
        return {s.queue_name for spec in self.catalogue for s in spec.stages} | {RESULTS_QUEUE, WEBHOOKS_QUEUE}

    @once_property
    def scheduler(self) -> Scheduler:
        return Scheduler(self.store, lambda: queue_capacity(self.redis), slack=self.settings.scheduler_slack)

    @once_property
    def quotas(self) -> Quotas:
        s = self.settings

        def read(key: str) -> dict[str, str]:
            return text_hash(self.redis.hgetall(key))

        return Quotas(read, QuotaDefaults(max_active=s.tenant_max_active, per_minute=s.tenant_jobs_per_minute))

    @once_property
    def reaper(self) -> Reaper:
        s = self.settings
        return Reaper(self.ledger, self.store, owner=self.worker, queues=self.queues,
                      queue_depth=lambda q: queue_depth(self.broker_redis, q),
                      dispatch_timeout_s=s.dispatch_timeout_s,
                      backlog_timeout_s=s.visibility_timeout_s, interval_s=s.reaper_interval_s,
                      grace_s=s.lease_s / 3 + 2 * s.reaper_interval_s, store_uptime_s=self._redis_uptime_s)

    def _redis_uptime_s(self) -> float:
        """Seconds since the job store's Redis server started (a restart is an outage every lease lapsed in)."""
        info = self.redis.info("server")
        return float(info.get("uptime_in_seconds", float("inf")))

    @once_property
    def broker_redis(self) -> Redis:
        """The Celery broker's Redis (the same server unless OMNI_BROKER_URL says otherwise)."""
        if self.settings.effective_broker_url == self.settings.redis_url:
            return self.redis
        return redis_client(self.settings.effective_broker_url, setting="OMNI_BROKER_URL")

    @once_property
    def submitter(self) -> JobSubmitter:
        s = self.settings
        admission = Admission(self.store, s.max_queued_per_queue, s.overload_retry_after_s)
        return JobSubmitter(self.ledger, self.catalogue, admission=admission, quotas=self.quotas,
                            idempotency_ttl_s=s.idempotency_ttl_s, max_cancel_after_s=s.max_cancel_after_s,
                            webhooks_enabled=s.webhook_secret is not None, artifacts=self.artifacts,
                            net_guard=self.net_guard, limits=Limits.from_settings(s))

    def present(self, job: Job, *, queue_position: int | None = None) -> JobJSON:
        """The public job object (the one shape of GET, SSE and webhooks)."""
        s = self.settings
        return present_job(job, public_url=s.public_url, artifacts=self.artifacts,
                           presign=s.output_urls == "presigned", queue_position=queue_position)

    @once_property
    def webhook_signer(self) -> WebhookSigner | None:
        """Signs with OMNI_WEBHOOK_SECRET (None when unset); ValueError, never quoting it, when malformed."""
        secret = self.settings.webhook_secret
        if secret is None:
            return None
        try:
            return WebhookSigner.from_setting(secret.get_secret_value())
        except ValueError as exc:
            raise ValueError(f"OMNI_WEBHOOK_SECRET is malformed: {exc}") from None

    @once_property
    def webhooks(self) -> WebhookDeliverer:
        """Makes webhook delivery attempts (the webhooks worker)."""
        s = self.settings
        try:
            signer, problem = self.webhook_signer, "this worker has no OMNI_WEBHOOK_SECRET to sign with"
        except ValueError as exc:
            signer, problem = None, str(exc)
        return WebhookDeliverer(ledger=self.ledger, render=self.present, signer=signer, unsigned_reason=problem,
                                policy=RetryPolicy.from_settings(s), timeout_s=s.webhook_timeout_s,
                                guard=self.net_guard, keeper=self.keeper, store_wait_s=s.store_wait_s)

    @once_property
    def net_guard(self) -> NetGuard:
        """SSRF guard of webhook URLs (submit and delivery), with OMNI_WEBHOOK_ALLOW_HOSTS."""
        return NetGuard(allow_hosts=tuple(self.settings.webhook_allow_hosts))

    @once_property
    def batches(self) -> Batches:
        """The OpenAI Batch API's files, batches and their lines' jobs (API routes, the console, the driver)."""
        s = self.settings
        signer = self.webhook_signer
        webhook = BatchWebhook(signer, self.webhooks.post, RetryPolicy.from_settings(s)) if signer is not None else None
        planner = LinePlanner(self.catalogue, self.submitter, s.openai_model_aliases, s.max_outputs)
        shaping = Shaping(read=self.artifacts.get, present=self.present,
                          url_of=lambda job, name: output_url(job, name, public_url=s.public_url,
                                                              artifacts=self.artifacts,
                                                              presign=s.output_urls == "presigned"),
                          output_ttl_s=s.output_ttl_s)
        records = DurableRecords(self.redis, wait_replicas=s.redis_wait_replicas, wait_aof=s.redis_wait_aof,
                                 timeout_ms=s.redis_wait_timeout_ms)
        files = FileStore(self.redis, self.artifacts, ttl_s=s.batch_file_ttl_s, records=records)
        return Batches(self.redis, files=files, planner=planner, submitter=self.submitter,
                       get_jobs=self.store.get_many, cancel_job=self.ledger.cancel, shaping=shaping,
                       max_in_flight=s.batch_max_in_flight, max_lines=s.batch_file_max_lines, webhook=webhook,
                       job_statuses=redis_job_statuses(self.redis))

    @once_property
    def batch_driver(self) -> BatchDriver:
        """Moves this runtime's batches along (not started: the worker that drives batches starts it)."""
        return BatchDriver(self.batches, poll_s=self.settings.batch_poll_s)
