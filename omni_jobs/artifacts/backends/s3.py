"""S3 backend: outputs and large intermediates shared across machines (AWS S3, MinIO, moto).

Uploads go through boto3's managed transfer (``upload_fileobj``), which switches to multipart
for large objects. Object lifetime is not per-object in S3: expire intermediates with a bucket
lifecycle rule on the prefix, and ``delete_prefix`` removes a job's objects when it is deleted.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeAlias
from urllib.parse import quote

from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError

from omni_jobs.artifacts.backends.base import (
    ArtifactError,
    ArtifactNotFound,
    ArtifactStoreUnavailable,
    PutItem,
    check_ttl,
    put_each,
    validate_key,
    validate_prefix,
)
from omni_jobs.artifacts.refs import BackendName

if TYPE_CHECKING:
    from omni_jobs.core.settings import Settings

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "ServiceUnavailable",
        "InternalError",
        "PriorRequestNotComplete",
        "OperationAborted",
    }
)
_DELETE_BATCH = 1000  # DeleteObjects limit

S3Client: TypeAlias = Any
"""A boto3 S3 client (``boto3.session.Session().client("s3")``): boto3 builds its clients at run time
and ships no type information (that would take the mypy-boto3-s3 stubs)."""


def _error_code(exc: ClientError) -> tuple[str, int, str]:
    err = exc.response.get("Error", {})
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return str(err.get("Code", "")), status, str(err.get("Message", ""))


def content_disposition(filename: str) -> str:
    """An RFC 6266 ``attachment`` header value: ASCII fallback plus UTF-8 ``filename*``."""
    name = filename.replace("\\", "/").rsplit("/", 1)[-1]
    fallback = "".join(c if 32 <= ord(c) < 127 and c not in '"%;' else "_" for c in name) or "download"
    value = f'attachment; filename="{fallback}"'
    if fallback != name:
        value += f"; filename*=UTF-8''{quote(name, safe='')}"
    return value


class S3Backend:
    """Artifacts as objects ``{prefix}{key}`` in ``bucket``; the bucket is created when missing."""

    def __init__(self, client: S3Client, bucket: str, prefix: str = "", *,
                 presign_client: S3Client | None = None) -> None:
        """``presign_client`` signs download URLs for an endpoint clients reach (when it differs from ours)."""
        if not bucket:
            raise ValueError("S3Backend needs a bucket name (OMNI_S3_BUCKET)")
        self._s3 = client
        self._presign = presign_client or client
        self._bucket = bucket
        prefix = prefix.lstrip("/")
        self._prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self._bucket_ready = False
        self._bucket_lock = threading.Lock()

    @property
    def name(self) -> BackendName:
        return "s3"

    @property
    def bucket(self) -> str:
        return self._bucket

    @property
    def client(self) -> S3Client:
        return self._s3

    def object_key(self, key: str) -> str:
        """The S3 object key of artifact ``key`` (the bucket prefix applied)."""
        return self._prefix + validate_key(key)

    @contextmanager
    def _guard(self, operation: str, key: str) -> Iterator[None]:
        try:
            yield
        except ClientError as exc:
            code, status, message = _error_code(exc)
            if code in _NOT_FOUND_CODES or status == 404:
                raise ArtifactNotFound(key, "s3", f"{code or status} in bucket {self._bucket!r}") from exc
            if code in _TRANSIENT_CODES or status >= 500 or status == 429:
                raise ArtifactStoreUnavailable("s3", operation, key, exc) from exc
            raise ArtifactError(
                f"s3 {operation} of {key!r} in bucket {self._bucket!r} failed: {code or status}: {message} "
                "(not transient: check the credentials, the bucket policy and the OMNI_S3_* settings)"
            ) from exc
        except (BotoConnectionError, HTTPClientError) as exc:
            raise ArtifactStoreUnavailable("s3", operation, key, exc) from exc
        except BotoCoreError as exc:
            raise ArtifactError(
                f"s3 {operation} of {key!r} failed: {exc} (check OMNI_S3_ENDPOINT_URL and credentials)"
            ) from exc

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (idempotent, safe to race with other workers)."""
        with self._bucket_lock, self._guard("create_bucket", self._bucket):
            try:
                self._s3.head_bucket(Bucket=self._bucket)
            except ClientError as exc:
                code, status, _ = _error_code(exc)
                if status != 404 and code not in ("NoSuchBucket", "NotFound", "404"):
                    raise
                kwargs: dict[str, object] = {"Bucket": self._bucket}
                region = self._s3.meta.region_name
                if region and region != "us-east-1":
                    kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
                try:
                    self._s3.create_bucket(**kwargs)
                except ClientError as create_exc:
                    if _error_code(create_exc)[0] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
            self._bucket_ready = True

    def put(self, key: str, data: bytes, *, ttl_s: int | None = None, media_type: str | None = None) -> None:
        check_ttl(ttl_s)
        obj = self.object_key(key)
        extra = {"ContentType": media_type} if media_type else {}
        if not self._bucket_ready:
            self.ensure_bucket()
        try:
            with self._guard("put", key):
                self._s3.upload_fileobj(io.BytesIO(data), self._bucket, obj, ExtraArgs=extra)
        except ArtifactNotFound:
            # The bucket vanished since we checked (deleted, or an in-memory test server restarted).
            self._bucket_ready = False
            self.ensure_bucket()
            with self._guard("put", key):
                self._s3.upload_fileobj(io.BytesIO(data), self._bucket, obj, ExtraArgs=extra)

    def put_many(self, items: Sequence[PutItem], *, ttl_s: int | None = None) -> None:
        put_each(self, items, ttl_s=ttl_s)

    def get(self, key: str) -> bytes:
        obj = self.object_key(key)
        with self._guard("get", key):
            body = self._s3.get_object(Bucket=self._bucket, Key=obj)["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()

    def exists(self, key: str) -> bool:
        obj = self.object_key(key)
        try:
            with self._guard("exists", key):
                self._s3.head_object(Bucket=self._bucket, Key=obj)
        except ArtifactNotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        obj = self.object_key(key)
        try:
            with self._guard("delete", key):
                self._s3.delete_object(Bucket=self._bucket, Key=obj)
        except ArtifactNotFound:
            return

    def delete_prefix(self, prefix: str) -> int:
        validate_prefix(prefix)
        deleted = 0
        try:
            with self._guard("delete_prefix", prefix):
                pages = self._s3.get_paginator("list_objects_v2").paginate(
                    Bucket=self._bucket, Prefix=self._prefix + prefix
                )
                for page in pages:
                    names = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                    for i in range(0, len(names), _DELETE_BATCH):
                        chunk = names[i : i + _DELETE_BATCH]
                        resp = self._s3.delete_objects(Bucket=self._bucket, Delete={"Objects": chunk, "Quiet": True})
                        errors = resp.get("Errors", [])
                        deleted += len(chunk) - len(errors)
                        if errors:
                            first = errors[0]
                            cause = f"{len(errors)} objects not deleted, e.g. {first.get('Key')}: {first.get('Code')}"
                            if first.get("Code") in _TRANSIENT_CODES:
                                raise ArtifactStoreUnavailable("s3", "delete_prefix", prefix, cause)
                            raise ArtifactError(f"s3 delete_prefix of {prefix!r}: {cause}")
        except ArtifactNotFound:  # no bucket: nothing to delete
            return deleted
        return deleted

    def presigned_url(self, key: str, *, expires_s: int, filename: str | None = None) -> str | None:
        if expires_s <= 0:
            raise ValueError(f"expires_s must be positive, got {expires_s}")
        params: dict[str, str] = {"Bucket": self._bucket, "Key": self.object_key(key)}
        if filename:
            params["ResponseContentDisposition"] = content_disposition(filename)
        with self._guard("presign", key):
            return str(self._presign.generate_presigned_url("get_object", Params=params, ExpiresIn=expires_s))


def s3_client_from_settings(
    settings: Settings, *, max_attempts: int = 5, connect_timeout_s: float = 5.0, endpoint_url: str | None = None
) -> S3Client:
    """A boto3 S3 client for the OMNI_S3_* settings (path-style addressing for custom endpoints)."""
    import boto3

    endpoint_url = endpoint_url or settings.s3_endpoint_url
    config = Config(
        region_name=settings.s3_region,
        signature_version="s3v4",
        s3={"addressing_style": "path"} if endpoint_url else {},
        retries={"max_attempts": max_attempts, "mode": "standard"},
        connect_timeout=connect_timeout_s,
        read_timeout=60,
    )
    # A private Session: boto3's default session is not safe to share between threads.
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=settings.s3_access_key_id,
        aws_secret_access_key=_secret(settings.s3_secret_access_key),
        config=config,
    )


def _secret(value: object) -> str | None:
    """The S3 secret's text: a SecretStr from settings (a plain str where a copy skipped validation)."""
    if value is None:
        return None
    reveal = getattr(value, "get_secret_value", None)
    return str(reveal() if reveal is not None else value)
