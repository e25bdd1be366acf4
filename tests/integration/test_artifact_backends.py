"""One behaviour contract, run against the redis, s3 (moto) and local backends; then the
backend-specific promises: Redis TTLs, S3 presigned downloads and multipart, and
ArtifactStoreUnavailable when a service goes away (and recovery when it comes back)."""

from __future__ import annotations

import os
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from omni_jobs.artifacts import (
    MEDIA_PNG,
    ArtifactBackend,
    ArtifactCorrupted,
    ArtifactNotFound,
    ArtifactStore,
    ArtifactStoreUnavailable,
    InvalidArtifactKey,
    LocalBackend,
    RedisBackend,
    S3Backend,
    artifact_store_from_settings,
    s3_client_from_settings,
)
from omni_jobs.core import keys
from omni_jobs.core.settings import Settings
from omni_jobs.local.devservices import start_moto_s3, start_redis

MiB = 1024 * 1024


@pytest.fixture(params=["redis", "s3", "local"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactBackend:
    if request.param == "redis":
        return RedisBackend(request.getfixturevalue("redis_client"))
    if request.param == "s3":
        return S3Backend(request.getfixturevalue("s3_client"), f"test-{uuid.uuid4().hex[:12]}", prefix="pfx")
    return LocalBackend(tmp_path / "artifacts")


def _job() -> str:
    return f"job_{uuid.uuid4().hex[:10]}"


# --- the contract, for every backend ---
def test_round_trip_binary_empty_and_overwrite(backend: ArtifactBackend) -> None:
    job = _job()
    key = keys.intermediate_artifact(job, "ar", "ids")
    data = bytes(range(256)) * 64
    backend.put(key, data, ttl_s=300)
    assert backend.get(key) == data and backend.exists(key)
    backend.put(key, b"v2", ttl_s=300)
    assert backend.get(key) == b"v2"
    backend.put(keys.intermediate_artifact(job, "ar", "empty"), b"", ttl_s=None)
    assert backend.get(keys.intermediate_artifact(job, "ar", "empty")) == b""


def test_put_many_stores_each_and_an_empty_list_is_nothing(backend: ArtifactBackend) -> None:
    job = _job()
    items = [(keys.intermediate_artifact(job, "ar", name), data, "application/octet-stream")
             for name, data in (("ids", b"\x00\x01" * 50), ("text.json", b'{"text": "a fox"}'), ("empty", b""))]
    backend.put_many(items, ttl_s=300)
    assert [backend.get(key) for key, _data, _media in items] == [data for _key, data, _media in items]
    backend.put_many([], ttl_s=300)
    with pytest.raises(InvalidArtifactKey):  # every key is checked before anything is written
        backend.put_many([(keys.intermediate_artifact(job, "ar", "late"), b"1", None), ("../escape", b"2", None)])
    assert not backend.exists(keys.intermediate_artifact(job, "ar", "late"))


def test_missing_key_raises_not_found_naming_the_key(backend: ArtifactBackend) -> None:
    key = keys.output_artifact(_job(), "nothing.png")
    with pytest.raises(ArtifactNotFound, match=key) as info:
        backend.get(key)
    assert info.value.key == key and info.value.backend == backend.name
    assert not backend.exists(key)


def test_delete_is_idempotent(backend: ArtifactBackend) -> None:
    key = keys.output_artifact(_job(), "a.json")
    backend.put(key, b"{}")
    backend.delete(key)
    backend.delete(key)
    assert not backend.exists(key)


def test_delete_prefix_counts_and_spares_lookalike_prefixes(backend: ArtifactBackend) -> None:
    job = _job()
    mine = [keys.intermediate_artifact(job, "ar", f"t{i}") for i in range(5)] + [keys.output_artifact(job, "x.png")]
    others = [keys.output_artifact(job + "0", "x.png"), keys.output_artifact(_job(), "x.png")]
    for key in mine + others:
        backend.put(key, b"x")
    assert backend.delete_prefix(keys.job_artifact_prefix(job)) == len(mine)
    assert not any(backend.exists(k) for k in mine)
    assert all(backend.exists(k) for k in others)
    assert backend.delete_prefix(keys.job_artifact_prefix(job)) == 0


def test_delete_prefix_treats_glob_characters_literally(backend: ArtifactBackend) -> None:
    a, b = "jobs/j[1]*?/x", "jobs/j1/x"
    backend.put(a, b"a")
    backend.put(b, b"b")
    assert backend.delete_prefix("jobs/j[1]*?/") == 1
    assert backend.exists(b) and not backend.exists(a)
    backend.delete(b)


def test_invalid_keys_are_refused_before_any_io(backend: ArtifactBackend) -> None:
    for key in ("../x", "/abs", "a//b", ""):
        with pytest.raises(InvalidArtifactKey):
            backend.put(key, b"x")
    with pytest.raises(InvalidArtifactKey):
        backend.delete_prefix("")


def test_store_verifies_size_and_sha_on_every_backend(backend: ArtifactBackend) -> None:
    store = ArtifactStore(backend)
    ref = store.put_output(keys.output_artifact(_job(), "img.png"), b"\x89PNG-ish", MEDIA_PNG)
    assert ref.backend == backend.name and store.get(ref) == b"\x89PNG-ish"
    backend.put(ref.key, b"\x89PNG-isX")
    with pytest.raises(ArtifactCorrupted, match="sha256"):
        store.get(ref)
    backend.put(ref.key, b"short")
    with pytest.raises(ArtifactCorrupted, match="bytes"):
        store.get(ref)


def test_presigned_url_only_where_the_backend_has_one(backend: ArtifactBackend) -> None:
    key = keys.output_artifact(_job(), "a.bin")
    backend.put(key, b"x")
    url = backend.presigned_url(key, expires_s=60)
    assert (url is not None) == (backend.name == "s3")


# --- Redis ---
def test_redis_ttl_is_set(redis_client: redis.Redis) -> None:
    backend = RedisBackend(redis_client)
    key = keys.intermediate_artifact(_job(), "ar", "ids")
    backend.put(key, b"x", ttl_s=120)
    assert 0 < redis_client.ttl(keys.artifact(key)) <= 120
    assert 0 < (backend.ttl(key) or 0) <= 120
    backend.put(key, b"x", ttl_s=None)
    assert redis_client.ttl(keys.artifact(key)) == -1 and backend.ttl(key) is None


def test_store_gives_small_intermediates_the_intermediate_ttl(redis_client: redis.Redis, tmp_path: Path) -> None:
    store = ArtifactStore(
        LocalBackend(tmp_path), RedisBackend(redis_client), small_max_bytes=1024, intermediate_ttl_s=3600
    )
    ref = store.put_intermediate(keys.intermediate_artifact(_job(), "ar", "h"), b"h" * 1024, "x/y")
    assert ref.backend == "redis"
    assert 3500 < redis_client.ttl(keys.artifact(ref.key)) <= 3600


# --- S3 ---
def test_s3_presigned_url_downloads_the_same_bytes_with_filename(s3_client: Any) -> None:
    backend = S3Backend(s3_client, f"test-{uuid.uuid4().hex[:12]}")
    store = ArtifactStore(backend, presign_expires_s=120)
    data = os.urandom(50_000)
    ref = store.put_output(keys.output_artifact(_job(), "image.png"), data, MEDIA_PNG)
    url = store.url(ref, filename="résumé image.png")
    assert url is not None and "X-Amz-Expires=120" in url
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.read() == data
        assert resp.headers["Content-Type"] == MEDIA_PNG
        disposition = resp.headers["Content-Disposition"]
    assert disposition.startswith('attachment; filename="r_sum_ image.png"')
    assert "filename*=UTF-8''r%C3%A9sum%C3%A9%20image.png" in disposition


def test_s3_large_object_uses_multipart_and_round_trips(s3_client: Any) -> None:
    backend = S3Backend(s3_client, f"test-{uuid.uuid4().hex[:12]}", prefix="omni/")
    data = os.urandom(12 * MiB)
    ref = ArtifactStore(backend).put_output(keys.output_artifact(_job(), "latents.safetensors"), data, "x/y")
    head = s3_client.head_object(Bucket=backend.bucket, Key="omni/" + ref.key)
    assert head["ContentLength"] == 12 * MiB
    assert head["ETag"].strip('"').endswith("-2")  # two 8 MiB-threshold parts: multipart happened
    assert ArtifactStore(backend).get(ref) == data


def test_s3_bucket_is_created_and_recreated_when_it_vanishes(s3_client: Any) -> None:
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    backend = S3Backend(s3_client, bucket, prefix="p")
    assert backend.delete_prefix("jobs/") == 0  # no bucket yet: nothing to delete, no error
    with pytest.raises(ArtifactNotFound):
        backend.get("jobs/j/x")
    backend.put("jobs/j/x", b"1")
    assert [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket)["Contents"]] == ["p/jobs/j/x"]
    s3_client.delete_object(Bucket=bucket, Key="p/jobs/j/x")
    s3_client.delete_bucket(Bucket=bucket)
    backend.put("jobs/j/y", b"2")
    assert backend.get("jobs/j/y") == b"2"


def test_redis_plus_s3_store_from_settings(redis_client: redis.Redis, s3_settings: Settings) -> None:
    settings = s3_settings.model_copy(update={"redis_artifact_max_bytes": 1000, "intermediate_ttl_s": 600})
    store = artifact_store_from_settings(settings, redis_client)
    job = _job()
    small = store.put_intermediate(keys.intermediate_artifact(job, "ar", "ids"), b"s" * 1000, "x/y")
    big = store.put_intermediate(keys.intermediate_artifact(job, "ar", "hidden"), b"b" * 1001, "x/y")
    out = store.put_output(keys.output_artifact(job, "audio.wav"), b"RIFF", "audio/wav")
    assert (small.backend, big.backend, out.backend) == ("redis", "s3", "s3")
    assert 0 < redis_client.ttl(keys.artifact(small.key)) <= 600
    assert [store.get(r) for r in (small, big, out)] == [b"s" * 1000, b"b" * 1001, b"RIFF"]
    assert store.url(small) is None and store.url(out) is not None
    assert store.delete_job(job) == 3
    assert not any(store.exists(r) for r in (small, big, out))


def test_a_stages_intermediates_go_where_their_size_says_in_request_order(
        redis_client: redis.Redis, s3_settings: Settings) -> None:
    settings = s3_settings.model_copy(update={"redis_artifact_max_bytes": 1000, "intermediate_ttl_s": 600})
    store = artifact_store_from_settings(settings, redis_client)
    job = _job()
    items = [(keys.intermediate_artifact(job, "ar", name), data, "x/y")
             for name, data in (("a", b"a" * 10), ("big", b"b" * 1001), ("c", b"c" * 1000))]
    refs = store.put_intermediates(items)
    assert [(r.key, r.backend) for r in refs] == [(items[0][0], "redis"), (items[1][0], "s3"), (items[2][0], "redis")]
    assert [store.get(r) for r in refs] == [b"a" * 10, b"b" * 1001, b"c" * 1000]
    assert all(0 < redis_client.ttl(keys.artifact(r.key)) <= 600 for r in (refs[0], refs[2]))
    index = keys.job_artifacts(job)  # the job's keys are found without a SCAN, and the set expires with them
    assert {m.decode() for m in redis_client.smembers(index)} == {items[0][0], items[2][0]}
    assert 0 < redis_client.ttl(index) <= 600
    assert store.delete_job(job) == 3


# --- faults: services go away and come back ---
@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[Any]:
    with start_redis(data_dir=tmp_path / "redis") as service:
        yield service


@pytest.mark.fault
def test_redis_down_is_unavailable_then_recovers(private_redis: Any) -> None:
    client = redis.Redis.from_url(private_redis.url, socket_connect_timeout=1, socket_timeout=1)
    backend = RedisBackend(client)
    backend.put("jobs/j/a", b"1", ttl_s=60)
    private_redis.stop()
    for call in (
        lambda: backend.put("jobs/j/b", b"2", ttl_s=60),
        lambda: backend.get("jobs/j/a"),
        lambda: backend.exists("jobs/j/a"),
        lambda: backend.delete("jobs/j/a"),
        lambda: backend.delete_prefix("jobs/j/"),
    ):
        with pytest.raises(ArtifactStoreUnavailable, match="redis backend unavailable"):
            call()
    private_redis.restart()
    backend.put("jobs/j/b", b"2", ttl_s=60)
    assert backend.get("jobs/j/b") == b"2"


@pytest.mark.fault
def test_s3_down_is_unavailable_then_recovers(tmp_path: Path) -> None:
    with start_moto_s3(log_dir=tmp_path) as service:
        settings = Settings(
            artifact_backend="s3", s3_endpoint_url=service.url, s3_access_key_id="t", s3_secret_access_key="t"
        )
        client = s3_client_from_settings(settings, max_attempts=1, connect_timeout_s=1)
        backend = S3Backend(client, "fault-bucket")
        backend.put("jobs/j/a", b"1")
        service.stop()
        for call in (
            lambda: backend.put("jobs/j/b", b"2"),
            lambda: backend.get("jobs/j/a"),
            lambda: backend.exists("jobs/j/a"),
            lambda: backend.delete("jobs/j/a"),
            lambda: backend.delete_prefix("jobs/j/"),
        ):
            with pytest.raises(ArtifactStoreUnavailable, match="s3 backend unavailable") as info:
                call()
            assert "jobs/j/" in str(info.value)
        service.restart()  # moto keeps nothing: the bucket is gone and must be recreated
        backend.put("jobs/j/b", b"2")
        assert backend.get("jobs/j/b") == b"2"
