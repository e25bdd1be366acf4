"""Redis backend: small intermediates, with a TTL so abandoned ones expire on their own."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import redis
import redis.exceptions as rex

from omni_jobs.artifacts.backends.base import (
    ArtifactNotFound,
    ArtifactStoreUnavailable,
    PutItem,
    check_ttl,
    validate_key,
    validate_prefix,
)
from omni_jobs.artifacts.refs import BackendName
from omni_jobs.core import keys
from omni_jobs.core.redis_replies import members

T = TypeVar("T")

_TRANSIENT: tuple[type[BaseException], ...] = (
    rex.ConnectionError,  # includes BusyLoadingError
    rex.TimeoutError,
    rex.ReadOnlyError,  # a replica during failover
    rex.TryAgainError,
    rex.ClusterDownError,
    rex.OutOfMemoryError,  # maxmemory reached: frees up as intermediates expire
)

_DELETE_BATCH = 500


def _job_of(key: str) -> str | None:
    """The job id of a key or prefix under ``jobs/<id>/``, else None."""
    parts = key.split("/", 2)
    return parts[1] if len(parts) == 3 and parts[0] == "jobs" and parts[1].startswith("job_") else None


def _glob_escape(text: str) -> str:
    """Escape Redis glob metacharacters so a prefix matches literally in SCAN MATCH."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisBackend:
    """Artifacts as Redis strings under ``keys.artifact(key)``; no presigned URLs."""

    def __init__(self, client: redis.Redis) -> None:
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError(
                "RedisBackend needs a client with decode_responses=False (artifacts are bytes); "
                "create a separate redis.Redis for artifacts"
            )
        self._r = client

    @property
    def name(self) -> BackendName:
        return "redis"

    @property
    def client(self) -> redis.Redis:
        return self._r

    @contextmanager
    def _guard(self, operation: str, key: str) -> Iterator[None]:
        try:
            yield
        except _TRANSIENT as exc:
            raise ArtifactStoreUnavailable("redis", operation, key, exc) from exc

    def _call(self, operation: str, key: str, fn: Callable[[], T]) -> T:
        with self._guard(operation, key):
            return fn()

    def put(self, key: str, data: bytes, *, ttl_s: int | None = None, media_type: str | None = None) -> None:
        """Store, and note the key in its job's artifact set (so the job's keys are found without a SCAN)."""
        self.put_many([(key, data, media_type)], ttl_s=ttl_s)

    def put_many(self, items: Sequence[PutItem], *, ttl_s: int | None = None) -> None:
        """``put`` of each, in one transaction: a stage's outputs cost one round trip."""
        if not items:
            return
        for key, _data, _media in items:
            validate_key(key)
        check_ttl(ttl_s)
        job_ids = [_job_of(key) for key, _data, _media in items]

        def write() -> None:
            with self._r.pipeline(transaction=True) as pipe:
                for (key, data, _media), job_id in zip(items, job_ids, strict=True):
                    pipe.set(keys.artifact(key), bytes(data), ex=ttl_s)
                    if job_id is not None:
                        pipe.sadd(keys.job_artifacts(job_id), key)
                for job_id in sorted({j for j in job_ids if j is not None}):
                    index = keys.job_artifacts(job_id)
                    if ttl_s is not None:  # the set lives as long as its longest-lived artifact
                        pipe.expire(index, ttl_s, gt=True)
                        pipe.expire(index, ttl_s, nx=True)
                    else:
                        pipe.persist(index)
                pipe.execute()

        self._call("put", items[0][0], write)

    def get(self, key: str) -> bytes:
        validate_key(key)
        value = self._call("get", key, lambda: self._r.get(keys.artifact(key)))
        if value is None:
            raise ArtifactNotFound(key, "redis", "missing or expired (intermediates have a TTL)")
        if not isinstance(value, bytes):  # decode_responses=False is checked in __init__
            raise TypeError(f"a decoding Redis client answered {type(value).__name__} for artifact {key!r}")
        return value

    def exists(self, key: str) -> bool:
        validate_key(key)
        return bool(self._call("exists", key, lambda: self._r.exists(keys.artifact(key))))

    def ttl(self, key: str) -> int | None:
        """Seconds left before ``key`` expires; None if it has no TTL; raises if missing."""
        validate_key(key)
        left = int(self._call("ttl", key, lambda: self._r.ttl(keys.artifact(key))))
        if left == -2:
            raise ArtifactNotFound(key, "redis")
        return None if left == -1 else left

    def delete(self, key: str) -> None:
        validate_key(key)
        self._call("delete", key, lambda: self._r.unlink(keys.artifact(key)))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every artifact under ``prefix``: a job's through its artifact set (its cost does not
        grow with the keyspace), any other prefix with a SCAN."""
        validate_prefix(prefix)
        job_id = _job_of(prefix)
        if job_id is not None:
            return self._delete_job_keys(job_id, prefix)
        pattern = _glob_escape(keys.artifact(prefix)) + "*"
        deleted = 0
        with self._guard("delete_prefix", prefix):
            batch: list[bytes] = []
            for name in self._r.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) >= _DELETE_BATCH:
                    deleted += int(self._r.unlink(*batch))
                    batch.clear()
            if batch:
                deleted += int(self._r.unlink(*batch))
        return deleted

    def _delete_job_keys(self, job_id: str, prefix: str) -> int:
        index = keys.job_artifacts(job_id)
        with self._guard("delete_prefix", prefix):
            doomed = [m for m in members(self._r.smembers(index)) if m.startswith(prefix)]
            if not doomed:
                return 0
            with self._r.pipeline(transaction=True) as pipe:
                pipe.unlink(*(keys.artifact(m) for m in doomed))
                pipe.srem(index, *doomed)
                deleted, _ = pipe.execute()
            return int(deleted)

    def presigned_url(self, key: str, *, expires_s: int, filename: str | None = None) -> str | None:
        validate_key(key)
        return None
