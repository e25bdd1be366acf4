"""ArtifactStore: put bytes somewhere sensible, get them back verified.

Small intermediates go to Redis (fast, and they expire on their own); large intermediates and
every final output go to the large backend (a directory or S3), which clients can download from.
Refs record which backend got the bytes, so a reader never needs to know the routing rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from omni_jobs.artifacts.backends import (
    ArtifactBackend,
    ArtifactCorrupted,
    ArtifactError,
    LocalBackend,
    RedisBackend,
    S3Backend,
    s3_client_from_settings,
    validate_key,
)
from omni_jobs.artifacts.refs import ArtifactRef, BackendName, sha256_hex
from omni_jobs.core import keys, telemetry

if TYPE_CHECKING:
    import redis

    from omni_jobs.core.settings import Settings

MiB = 1024 * 1024


class ArtifactStore:
    """Routes artifacts between an optional small backend (Redis) and a large one (local or S3)."""

    def __init__(
        self,
        large: ArtifactBackend,
        small: ArtifactBackend | None = None,
        *,
        small_max_bytes: int = 1 * MiB,
        intermediate_ttl_s: int | None = 24 * 3600,
        output_ttl_s: int | None = None,
        presign_expires_s: int = 3600,
    ) -> None:
        if small is not None and small.name == large.name:
            raise ValueError(f"small and large backends are both named {large.name!r}: refs could not tell them apart")
        self.large = large
        self.small = small
        self.small_max_bytes = small_max_bytes
        self.intermediate_ttl_s = intermediate_ttl_s
        self.output_ttl_s = output_ttl_s
        self.presign_expires_s = presign_expires_s

    @property
    def backends(self) -> tuple[ArtifactBackend, ...]:
        return (self.large,) if self.small is None else (self.small, self.large)

    def backend(self, name: BackendName) -> ArtifactBackend:
        """The backend a ref names; a clear error when this process is configured without it."""
        for b in self.backends:
            if b.name == name:
                return b
        configured = ", ".join(b.name for b in self.backends)
        raise ArtifactError(
            f"artifact is in the {name!r} backend but this store has only [{configured}]: "
            f"every API and worker process must share the same OMNI_ARTIFACT_BACKEND and OMNI_REDIS_URL"
        )

    def _put(self, backend: ArtifactBackend, key: str, data: bytes, media_type: str, ttl_s: int | None) -> ArtifactRef:
        return self._put_many(backend, [(key, data, media_type)], ttl_s)[0]

    def _put_many(self, backend: ArtifactBackend, items: Sequence[tuple[str, bytes, str]],
                  ttl_s: int | None) -> list[ArtifactRef]:
        for key, _data, _media in items:
            validate_key(key)
        stored = [(key, bytes(data), media_type) for key, data, media_type in items]
        refs = [ArtifactRef.for_bytes(backend.name, key, data, media_type) for key, data, media_type in stored]
        backend.put_many(stored, ttl_s=ttl_s)
        for _key, data, _media in stored:
            telemetry.artifact_io(backend.name, "put", len(data))
        return refs

    def put_intermediate(self, key: str, data: bytes, media_type: str) -> ArtifactRef:
        """Store stage-to-stage bytes: Redis when small enough (with a TTL), else the large backend."""
        return self.put_intermediates([(key, data, media_type)])[0]

    def put_intermediates(self, items: Sequence[tuple[str, bytes, str]]) -> list[ArtifactRef]:
        """``put_intermediate`` of each (key, data, media type), in request order: the ones routed to
        the same backend are stored together (one Redis transaction for a stage's small outputs)."""
        small = [self.small is not None and len(data) <= self.small_max_bytes for _key, data, _media in items]
        refs: dict[int, ArtifactRef] = {}
        for backend, routed in ((self.small, True), (self.large, False)):
            picked = [i for i, is_small in enumerate(small) if is_small is routed]
            if backend is not None and picked:
                made = self._put_many(backend, [items[i] for i in picked], self.intermediate_ttl_s)
                refs.update(zip(picked, made, strict=True))
        return [refs[i] for i in range(len(items))]

    def put_output(self, key: str, data: bytes, media_type: str) -> ArtifactRef:
        """Store a final output: always the large backend, where clients can download it."""
        return self._put(self.large, key, data, media_type, self.output_ttl_s)

    def get(self, ref: ArtifactRef) -> bytes:
        """The ref's bytes, verified against its size and sha256 (ArtifactCorrupted otherwise)."""
        data = self.backend(ref.backend).get(ref.key)
        telemetry.artifact_io(ref.backend, "get", len(data))
        if len(data) != ref.size:
            raise ArtifactCorrupted(
                f"artifact {ref.key!r} in {ref.backend}: expected {ref.size} bytes, got {len(data)} "
                "(overwritten or truncated; rerun the stage that wrote it)"
            )
        digest = sha256_hex(data)
        if digest != ref.sha256:
            raise ArtifactCorrupted(
                f"artifact {ref.key!r} in {ref.backend}: sha256 {digest} != expected {ref.sha256} "
                "(overwritten or corrupted; rerun the stage that wrote it)"
            )
        return data

    def exists(self, ref: ArtifactRef) -> bool:
        """Whether the ref's key is present (size and hash are checked only on get)."""
        return self.backend(ref.backend).exists(ref.key)

    def delete(self, ref: ArtifactRef) -> None:
        """Remove the ref's bytes; deleting a missing artifact is not an error."""
        self.backend(ref.backend).delete(ref.key)

    def url(self, ref: ArtifactRef, *, expires_s: int | None = None, filename: str | None = None) -> str | None:
        """A presigned download URL, or None when the backend has none (the API serves the bytes)."""
        return self.backend(ref.backend).presigned_url(
            ref.key, expires_s=expires_s or self.presign_expires_s, filename=filename
        )

    def delete_job(self, job_id: str) -> int:
        """Delete everything a job wrote, in every backend; returns how many artifacts went."""
        _check_job_id(job_id)
        prefix = keys.job_artifact_prefix(job_id)
        return sum(b.delete_prefix(prefix) for b in self.backends)

    def delete_job_intermediates(self, job_id: str) -> int:
        """Delete what a job's stages handed each other, keeping its final outputs."""
        _check_job_id(job_id)
        prefix = keys.job_intermediates_prefix(job_id)
        return sum(b.delete_prefix(prefix) for b in self.backends)


def _check_job_id(job_id: str) -> None:
    """A job id becomes a key prefix: refuse ones that would reach outside the job's own keys."""
    if not job_id or "/" in job_id or job_id in (".", ".."):
        raise ValueError(f"invalid job id {job_id!r}")


def artifact_store_from_settings(settings: Settings, redis_client: redis.Redis | None = None) -> ArtifactStore:
    """The store every process builds from its Settings.

    Without ``redis_client`` (or with ``redis_artifact_max_bytes == 0``) there is no small
    backend and every artifact goes to the large one: the in-process runner needs no Redis.
    """
    large: ArtifactBackend
    if settings.artifact_backend == "s3":
        public = settings.s3_public_endpoint_url
        presign = s3_client_from_settings(settings, endpoint_url=public) if public else None
        client = s3_client_from_settings(settings, max_attempts=settings.s3_max_attempts)
        large = S3Backend(client, settings.s3_bucket, settings.s3_prefix,
                          presign_client=presign)
    else:
        large = LocalBackend(settings.artifacts_dir)
    small = RedisBackend(redis_client) if redis_client is not None and settings.redis_artifact_max_bytes > 0 else None
    return ArtifactStore(
        large,
        small,
        small_max_bytes=settings.redis_artifact_max_bytes,
        intermediate_ttl_s=settings.intermediate_ttl_s,
        output_ttl_s=settings.output_ttl_s,
        presign_expires_s=settings.presign_expires_s,
    )
