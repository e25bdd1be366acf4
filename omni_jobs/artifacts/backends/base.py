"""The backend contract and its errors, shared by the redis, s3 and local backends.

Every backend accepts the same keys and raises the same errors, so the store can route an
artifact to any of them by size alone and callers handle one error vocabulary:
``ArtifactNotFound`` (the key is not there: a bug or an expired intermediate, do not retry) and
``ArtifactStoreUnavailable`` (the service is down or throttling: retry later).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeAlias, runtime_checkable

from omni_jobs.artifacts.refs import BackendName

MAX_KEY_BYTES = 1024
"""S3's key limit; applied everywhere so a key valid for one backend is valid for all."""


class ArtifactError(Exception):
    """Base of every artifact-store error."""


class ArtifactNotFound(ArtifactError, LookupError):
    """The key is not in the backend (never written, deleted, or expired)."""

    def __init__(self, key: str, backend: str, detail: str = "") -> None:
        self.key = key
        self.backend = backend
        msg = f"artifact {key!r} not found in the {backend} backend"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class ArtifactStoreUnavailable(ArtifactError):
    """A transient failure (connection refused, timeout, 5xx, throttling): the caller may retry."""

    def __init__(self, backend: str, operation: str, key: str, cause: BaseException | str) -> None:
        self.backend = backend
        self.operation = operation
        self.key = key
        super().__init__(
            f"{backend} backend unavailable during {operation} of {key!r}: {cause} "
            f"(transient: retry later, and check that the {backend} service is running and reachable)"
        )


class ArtifactCorrupted(ArtifactError):
    """The bytes read back do not match the ref's size or sha256."""


class InvalidArtifactKey(ArtifactError, ValueError):
    """The key is empty, absolute, escapes its root ('..'), or is otherwise unusable."""


def validate_key(key: str) -> str:
    """Reject keys that could escape a directory or differ between backends; return the key."""
    if not isinstance(key, str) or not key:
        raise InvalidArtifactKey(f"artifact key must be a non-empty string, got {key!r}")
    if "\x00" in key or "\\" in key:
        raise InvalidArtifactKey(f"artifact key {key!r} contains NUL or a backslash; use '/' separators")
    if key.startswith("/"):
        raise InvalidArtifactKey(f"artifact key {key!r} is absolute; use a relative key like 'jobs/ID/...'")
    if key.endswith("/"):
        raise InvalidArtifactKey(f"artifact key {key!r} ends with '/'; that is a prefix, not a key")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise InvalidArtifactKey(f"artifact key {key!r} has an empty, '.' or '..' segment")
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise InvalidArtifactKey(f"artifact key {key[:60]!r}... is longer than {MAX_KEY_BYTES} bytes")
    return key


def validate_prefix(prefix: str) -> str:
    """Prefixes follow key rules (a trailing '/' allowed) and may not be empty: '' would wipe all."""
    if not isinstance(prefix, str) or not prefix:
        raise InvalidArtifactKey("refusing an empty prefix: it would delete every artifact")
    validate_key(prefix.rstrip("/") or "/")
    if prefix.endswith("//"):
        raise InvalidArtifactKey(f"artifact prefix {prefix!r} has an empty segment")
    return prefix


def check_ttl(ttl_s: int | None) -> None:
    """A TTL is a positive number of seconds, or None for 'keep until deleted'."""
    if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s <= 0):
        raise ValueError(f"ttl_s must be a positive int or None, got {ttl_s!r}")


PutItem: TypeAlias = tuple[str, bytes, str | None]
"""One artifact to store: (key, data, media type or None)."""


@runtime_checkable
class ArtifactBackend(Protocol):
    """Byte storage under string keys; implemented by RedisBackend, S3Backend and LocalBackend."""

    @property
    def name(self) -> BackendName:
        """The backend name recorded in refs: 'redis', 's3' or 'local'."""
        ...

    def put(self, key: str, data: bytes, *, ttl_s: int | None = None, media_type: str | None = None) -> None:
        """Store ``data`` under ``key`` (replacing it); ``ttl_s`` is honoured where the backend can."""
        ...

    def put_many(self, items: Sequence[PutItem], *, ttl_s: int | None = None) -> None:
        """``put`` of each (key, data, media type), in one round trip where the backend can (a stage's
        outputs are stored together)."""
        ...

    def get(self, key: str) -> bytes:
        """The bytes under ``key``; raises ArtifactNotFound naming the key."""
        ...

    def exists(self, key: str) -> bool:
        """Whether ``key`` holds an artifact."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error (deletes are retried)."""
        ...

    def delete_prefix(self, prefix: str) -> int:
        """Remove every key starting with ``prefix``; return how many were removed."""
        ...

    def presigned_url(self, key: str, *, expires_s: int, filename: str | None = None) -> str | None:
        """A time-limited download URL, or None where the backend has none (redis, local)."""
        ...


def put_each(backend: ArtifactBackend, items: Sequence[PutItem], *, ttl_s: int | None = None) -> None:
    """``put_many`` of a backend with one request per artifact (a file each, an object each); every key
    is checked before the first is written."""
    for key, _data, _media_type in items:
        validate_key(key)
    for key, data, media_type in items:
        backend.put(key, data, ttl_s=ttl_s, media_type=media_type)
