"""Byte storage behind the artifact store: one contract, three backends (redis, s3, local)."""

from omni_jobs.artifacts.backends.base import (
    ArtifactBackend,
    ArtifactCorrupted,
    ArtifactError,
    ArtifactNotFound,
    ArtifactStoreUnavailable,
    InvalidArtifactKey,
    validate_key,
    validate_prefix,
)
from omni_jobs.artifacts.backends.local import LocalBackend
from omni_jobs.artifacts.backends.redis_backend import RedisBackend
from omni_jobs.artifacts.backends.s3 import S3Backend, content_disposition, s3_client_from_settings

__all__ = [
    "ArtifactBackend",
    "ArtifactCorrupted",
    "ArtifactError",
    "ArtifactNotFound",
    "ArtifactStoreUnavailable",
    "InvalidArtifactKey",
    "LocalBackend",
    "RedisBackend",
    "S3Backend",
    "content_disposition",
    "s3_client_from_settings",
    "validate_key",
    "validate_prefix",
]
