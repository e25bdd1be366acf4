"""Wiring: build every core component from one Settings, for the API, the workers and tests.

Components are made lazily and once per process, so the API never loads an engine and a worker
loads only the engines its tasks ask for.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from redis import Redis

from omni_jobs.artifacts import ArtifactStore, artifact_store_from_settings
from omni_jobs.batching import BatchDefaults
from omni_jobs.dispatch import Dispatcher
from omni_jobs.engines.cache import EngineCache
from omni_jobs.jobs.models import Job
from omni_jobs.jobs.store import JobStore
from omni_jobs.jobs.view import present_job
from omni_jobs.limits import Limits
from omni_jobs.metrics import record_job_events
from omni_jobs.net_guard import NetGuard
from omni_jobs.pipelines.catalogue import PipelineCatalogue, load_catalogue
from omni_jobs.results import ResultsAssembler
from omni_jobs.settings import Settings
from omni_jobs.stages import StageLimits, StageRunner
from omni_jobs.submission import Admission, JobSubmitter
from omni_jobs.webhooks import RetryPolicy, WebhookDeliverer, WebhookNotifier, WebhookSigner


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @cached_property
    def redis(self) -> Redis:
        return Redis.from_url(self.settings.redis_url, health_check_interval=30)

    @cached_property
    def jobs(self) -> JobStore:
        store = JobStore(self.redis, ttl_s=self.settings.output_ttl_s)
        store.listeners.append(record_job_events)  # this process's Prometheus job and stage metrics
        return store

    @cached_property
    def catalogue(self) -> PipelineCatalogue:
        return load_catalogue(self.settings.pipelines_path)

    @cached_property
    def artifacts(self) -> ArtifactStore:
        return artifact_store_from_settings(self.settings, redis_client=self.redis)

    @cached_property
    def engines(self) -> EngineCache:
        s = self.settings
        return EngineCache(s.models_dir, kv_cache_bytes=s.ar_kv_cache_bytes, max_model_len=s.ar_max_model_len,
                           device=s.device)

    @cached_property
    def stage_runner(self) -> StageRunner:
        s = self.settings
        limits = StageLimits(soft_time_limit_s=s.stage_soft_time_limit_s, time_limit_s=s.stage_time_limit_s,
                             progress_interval_s=s.progress_interval_s)
        batching = BatchDefaults(max_batch_size=s.batch_max_size, wait_ms=s.batch_wait_ms,
                                 max_in_flight=s.stage_max_in_flight)
        return StageRunner(store=self.jobs, catalogue=self.catalogue, artifacts=self.artifacts, engines=self.engines,
                           limits=limits, batching=batching, cache_redis=self.redis,
                           cache_defaults=(s.stage_cache_max_entries, s.stage_cache_eviction))

    @cached_property
    def results(self) -> ResultsAssembler:
        return ResultsAssembler(store=self.jobs, catalogue=self.catalogue, artifacts=self.artifacts)

    @cached_property
    def broker_redis(self) -> Redis:
        """The Celery broker's Redis (the same server unless OMNI_BROKER_URL says otherwise)."""
        if self.settings.effective_broker_url == self.settings.redis_url:
            return self.redis
        return Redis.from_url(self.settings.effective_broker_url)

    def submitter(self, dispatcher: Dispatcher) -> JobSubmitter:
        s = self.settings
        admission = Admission(self.broker_redis, s.max_queued_per_queue, s.overload_retry_after_s)
        return JobSubmitter(self.jobs, self.catalogue, dispatcher, admission=admission,
                            idempotency_ttl_s=s.idempotency_ttl_s, max_cancel_after_s=s.max_cancel_after_s,
                            webhooks_enabled=s.webhook_secret is not None, artifacts=self.artifacts,
                            net_guard=self.net_guard, limits=Limits.from_settings(s))

    def present(self, job: Job, *, queue_position: int | None = None) -> dict[str, Any]:
        """The public job object (the one shape of GET, SSE and webhooks)."""
        s = self.settings
        return present_job(job, public_url=s.public_url, artifacts=self.artifacts,
                           presign=s.output_urls == "presigned", queue_position=queue_position)

    def enable_webhooks(self, dispatcher: Dispatcher) -> None:
        """Send webhooks for the job changes this process commits, through ``dispatcher`` (once per process)."""
        if any(isinstance(listener, WebhookNotifier) for listener in self.jobs.listeners):
            return
        self.jobs.listeners.append(
            WebhookNotifier(self.redis, dispatcher, progress_interval_s=self.settings.webhook_progress_interval_s)
        )

    @cached_property
    def webhook_signer(self) -> WebhookSigner | None:
        """Signs with OMNI_WEBHOOK_SECRET (None when unset); ValueError, never quoting it, when malformed."""
        secret = self.settings.webhook_secret
        if secret is None:
            return None
        try:
            return WebhookSigner.from_setting(secret.get_secret_value())
        except ValueError as exc:
            raise ValueError(f"OMNI_WEBHOOK_SECRET is malformed: {exc}") from None

    @cached_property
    def webhooks(self) -> WebhookDeliverer:
        """Makes webhook delivery attempts (the webhooks worker)."""
        s = self.settings
        try:
            signer, problem = self.webhook_signer, "this worker has no OMNI_WEBHOOK_SECRET to sign with"
        except ValueError as exc:
            signer, problem = None, str(exc)
        return WebhookDeliverer(store=self.jobs, render=self.present, signer=signer, unsigned_reason=problem,
                                policy=RetryPolicy.from_settings(s), timeout_s=s.webhook_timeout_s,
                                deliveries_kept=s.webhook_deliveries_kept, guard=self.net_guard)

    @cached_property
    def net_guard(self) -> NetGuard:
        """SSRF guard of webhook URLs (submit and delivery), with OMNI_WEBHOOK_ALLOW_HOSTS."""
        return NetGuard(allow_hosts=tuple(self.settings.webhook_allow_hosts))
