"""Wiring: build every core component from one Settings, for the API, the workers and tests.

Components are made lazily and once per process, so the API never loads an engine and a worker
loads only the engines its tasks ask for.
"""

from __future__ import annotations

from functools import cached_property

import redis

from omni_jobs.artifacts import ArtifactStore, artifact_store_from_settings
from omni_jobs.dispatch import Dispatcher
from omni_jobs.engines.cache import EngineCache
from omni_jobs.jobs.store import JobStore
from omni_jobs.pipelines.catalogue import PipelineCatalogue, load_catalogue
from omni_jobs.results import ResultsAssembler
from omni_jobs.settings import Settings
from omni_jobs.stages import StageRunner
from omni_jobs.submission import JobSubmitter


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @cached_property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.settings.redis_url, health_check_interval=30)

    @cached_property
    def jobs(self) -> JobStore:
        return JobStore(self.redis, ttl_s=self.settings.output_ttl_s)

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
        return StageRunner(store=self.jobs, catalogue=self.catalogue, artifacts=self.artifacts, engines=self.engines)

    @cached_property
    def results(self) -> ResultsAssembler:
        return ResultsAssembler(store=self.jobs, catalogue=self.catalogue, artifacts=self.artifacts)

    def submitter(self, dispatcher: Dispatcher) -> JobSubmitter:
        return JobSubmitter(self.jobs, self.catalogue, dispatcher)
