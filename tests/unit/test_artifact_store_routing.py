"""ArtifactStore routing and verification, with two directories standing in for both backends."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from pydantic import ValidationError

from omni_jobs.artifacts import (
    MEDIA_PNG,
    MEDIA_SAFETENSORS,
    ArtifactCorrupted,
    ArtifactError,
    ArtifactRef,
    ArtifactStore,
    LocalBackend,
    RedisBackend,
    S3Backend,
    artifact_store_from_settings,
    sha256_hex,
)
from omni_jobs.core import keys
from omni_jobs.core.settings import Settings

SMALL_MAX = 100


@pytest.fixture
def small(tmp_path: Path) -> LocalBackend:
    return LocalBackend(tmp_path / "small", name="redis")  # a directory standing in for Redis


@pytest.fixture
def large(tmp_path: Path) -> LocalBackend:
    return LocalBackend(tmp_path / "large")


@pytest.fixture
def store(small: LocalBackend, large: LocalBackend) -> ArtifactStore:
    return ArtifactStore(large, small, small_max_bytes=SMALL_MAX, intermediate_ttl_s=60)


def test_intermediates_route_by_size_with_inclusive_limit(
    store: ArtifactStore, small: LocalBackend, large: LocalBackend
) -> None:
    at_limit = store.put_intermediate(keys.intermediate_artifact("j", "ar", "a"), b"x" * SMALL_MAX, MEDIA_SAFETENSORS)
    over = store.put_intermediate(keys.intermediate_artifact("j", "ar", "b"), b"x" * (SMALL_MAX + 1), MEDIA_SAFETENSORS)
    assert at_limit.backend == "redis" and small.exists(at_limit.key) and not large.exists(at_limit.key)
    assert over.backend == "local" and large.exists(over.key) and not small.exists(over.key)
    assert store.get(at_limit) == b"x" * SMALL_MAX and store.get(over) == b"x" * (SMALL_MAX + 1)


def test_outputs_always_go_to_the_large_backend(store: ArtifactStore, large: LocalBackend) -> None:
    ref = store.put_output(keys.output_artifact("j", "image.png"), b"tiny", MEDIA_PNG)
    assert ref.backend == "local" and large.exists(ref.key)


def test_without_small_backend_everything_is_large(large: LocalBackend) -> None:
    store = ArtifactStore(large)
    ref = store.put_intermediate("jobs/j/stages/ar/x", b"1", "application/json")
    assert ref.backend == "local" and store.backends == (large,)


def test_ref_records_size_hash_and_media_type_and_round_trips_json(store: ArtifactStore) -> None:
    data = b"hello artifacts"
    ref = store.put_intermediate("jobs/j/stages/ar/text", data, "application/json")
    assert ref.size == len(data) and ref.sha256 == sha256_hex(data) and ref.media_type == "application/json"
    assert ArtifactRef.model_validate_json(ref.model_dump_json()) == ref
    assert ArtifactRef.model_validate(ref.model_dump(mode="json")) == ref
    assert len(ref.model_dump_json()) < 250  # small enough for every Celery message
    with pytest.raises(ValidationError):
        ref.size = 3  # type: ignore[misc]
    with pytest.raises(ValidationError):
        ArtifactRef.model_validate({"backend": "ftp", "key": "k", "media_type": "x", "size": 0, "sha256": "0" * 64})


def test_get_detects_truncation_and_same_size_corruption(store: ArtifactStore, large: LocalBackend) -> None:
    ref = store.put_output("jobs/j/outputs/a.bin", b"abcdef", "application/octet-stream")
    large.put(ref.key, b"abc")
    with pytest.raises(ArtifactCorrupted, match="expected 6 bytes, got 3"):
        store.get(ref)
    large.put(ref.key, b"abcdeX")
    with pytest.raises(ArtifactCorrupted, match=r"sha256 .* != expected") as info:
        store.get(ref)
    assert "jobs/j/outputs/a.bin" in str(info.value)


def test_exists_delete_and_url(store: ArtifactStore) -> None:
    ref = store.put_intermediate("jobs/j/stages/ar/x", b"1", "application/json")
    assert store.exists(ref)
    assert store.url(ref) is None and store.url(ref, expires_s=5, filename="x.json") is None
    store.delete(ref)
    store.delete(ref)
    assert not store.exists(ref)


def test_ref_for_an_unconfigured_backend_is_a_clear_error(large: LocalBackend) -> None:
    store = ArtifactStore(large)
    ref = ArtifactRef(backend="s3", key="jobs/j/x", media_type="x", size=1, sha256="0" * 64)
    with pytest.raises(ArtifactError, match="OMNI_ARTIFACT_BACKEND"):
        store.get(ref)


def test_delete_job_covers_every_backend_and_only_that_job(store: ArtifactStore) -> None:
    refs = [
        store.put_intermediate(keys.intermediate_artifact("j1", "ar", "small"), b"s", "x/y"),
        store.put_intermediate(keys.intermediate_artifact("j1", "ar", "big"), b"b" * 500, "x/y"),
        store.put_output(keys.output_artifact("j1", "out.png"), b"png", MEDIA_PNG),
        store.put_output(keys.input_artifact("j1", "init.png"), b"png", MEDIA_PNG),
    ]
    keep = [
        store.put_intermediate(keys.intermediate_artifact("j10", "ar", "small"), b"s", "x/y"),
        store.put_output(keys.output_artifact("j10", "out.png"), b"png", MEDIA_PNG),
    ]
    assert store.delete_job("j1") == 4
    assert not any(store.exists(r) for r in refs)
    assert all(store.exists(r) for r in keep)
    for bad in ("", "a/b", ".."):
        with pytest.raises(ValueError):
            store.delete_job(bad)


def test_backends_with_the_same_name_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="both named"):
        ArtifactStore(LocalBackend(tmp_path / "a"), LocalBackend(tmp_path / "b"))


def test_from_settings_local_without_redis(tmp_path: Path) -> None:
    settings = Settings(artifacts_dir=tmp_path / "arts", intermediate_ttl_s=77, presign_expires_s=99)
    store = artifact_store_from_settings(settings)
    assert store.small is None
    assert isinstance(store.large, LocalBackend) and store.large.root == (tmp_path / "arts").resolve()
    assert store.intermediate_ttl_s == 77 and store.presign_expires_s == 99


def test_from_settings_s3_with_redis_builds_without_connecting() -> None:
    settings = Settings(
        artifact_backend="s3",
        s3_endpoint_url="http://127.0.0.1:9",
        s3_bucket="b",
        s3_prefix="omni",
        s3_access_key_id="k",
        s3_secret_access_key="s",
        redis_artifact_max_bytes=1234,
    )
    client = redis.Redis.from_url("redis://127.0.0.1:9/0")  # lazy: never contacted here
    store = artifact_store_from_settings(settings, client)
    assert isinstance(store.small, RedisBackend) and isinstance(store.large, S3Backend)
    assert store.small_max_bytes == 1234
    assert store.large.bucket == "b" and store.large.object_key("jobs/j/x") == "omni/jobs/j/x"
    assert (
        artifact_store_from_settings(settings.model_copy(update={"redis_artifact_max_bytes": 0}), client).small is None
    )


def test_redis_backend_refuses_a_decoding_client() -> None:
    with pytest.raises(ValueError, match="decode_responses"):
        RedisBackend(redis.Redis.from_url("redis://127.0.0.1:9/0", decode_responses=True))
