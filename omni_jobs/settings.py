"""One Settings object for every process, read from ``OMNI_*`` environment variables.

Every field has a default that works on a single machine with no services configured, so the
embedded demo and the tests need no environment at all; deployments override what they need.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024


class Settings(BaseSettings):
    """Configuration shared by the API, the workers and the in-process runner."""

    model_config = SettingsConfigDict(env_prefix="OMNI_", env_file=None, extra="ignore")

    # --- Redis: job state, events, small artifacts, and (by default) the Celery broker ---
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for job state and small artifacts.")
    broker_url: str | None = Field(None, description="Celery broker URL; defaults to redis_url.")

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
    s3_bucket: str = Field("omni-jobs", description="Bucket of the s3 backend (created if missing).")
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint (MinIO, moto); None means AWS.")
    s3_public_endpoint_url: str | None = Field(
        None, description="Endpoint that presigned download URLs name, when clients reach S3 at another address."
    )
    s3_region: str = Field("us-east-1", description="S3 region.")
    s3_access_key_id: str | None = Field(None, description="S3 key id; None uses boto3's usual lookup.")
    s3_secret_access_key: str | None = Field(None, description="S3 secret; None uses boto3's usual lookup.")
    s3_prefix: str = Field("", description="Key prefix inside the bucket.")
    output_urls: Literal["presigned", "api"] = Field(
        "presigned", description="Output URLs in job JSON: presigned store URLs where the store has them, or the API."
    )
    presign_expires_s: int = Field(3600, gt=0, description="Lifetime of presigned output URLs.")

    # --- Models and pipelines ---
    models_dir: Path = Field(Path("var/models"), description="Where omni_jobs.tiny builds the local models.")
    pipelines_path: list[Path] = Field(
        default_factory=list, description="Extra pipeline YAML files or directories (JSON list in env)."
    )

    # --- Engines ---
    ar_kv_cache_bytes: int = Field(256 * MiB, gt=0, description="vLLM KV-cache size per AR engine.")
    ar_max_model_len: int = Field(512, gt=0, description="Default vLLM max_model_len.")
    device: str = Field("auto", description="Torch device for diffusers: auto, cpu, cuda, cuda:N.")
    preload_engines: bool = Field(True, description="Workers load their stages' engines at start, not on first task.")

    # --- Queues ---
    visibility_timeout_s: int = Field(
        3600, gt=0, description="Broker redelivers an unacknowledged task after this; keep it above the longest stage."
    )
    stage_max_retries: int = Field(5, ge=0, description="Retries of a stage after a transient error (store down).")
    stage_retry_backoff_s: float = Field(1.0, gt=0, description="First retry delay; doubles each retry, with jitter.")

    # --- API ---
    public_url: str = Field("http://127.0.0.1:8000", description="Base URL clients use to reach the API.")
    max_page_size: int = Field(100, gt=0, description="Largest page GET /v1/jobs returns.")

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (tests build their own Settings instead)."""
    return Settings()
