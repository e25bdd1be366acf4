"""Shared pytest configuration: markers, test-directory marking, and the real services.

The service fixtures (a private redis-server, a moto S3 endpoint) start once per session on free
ports, never the developer's own Redis on 6379, and only when a test asks for them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from omni_jobs.artifacts import s3_client_from_settings
from omni_jobs.core.settings import Settings
from omni_jobs.local.devservices import RunningService, start_moto_s3, start_redis

MARKERS = {
    "integration": "needs real local services (redis-server, moto S3, Celery workers)",
    "e2e": "end-to-end: API + workers + services together",
    "slow": "takes more than a few seconds",
    "fault": "stops or kills a service or worker on purpose",
    "chaos": "heavy fault runs: 200 jobs while every process is SIGKILLed, the Redis failover, vLLM engine-core kills "
             "(minutes; deselected by default)",
    "docker": "builds images and runs the compose stack in Docker (opt-in: OMNI_DOCKER_TESTS=1)",
    "ui": "the web console (tests/ui): HTTP rules, and pages in a real browser (Playwright + chromium)",
}

_HERE = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")


FIRST = ("unit/test_typing.py",)
"""Run before everything else: mypy takes ~2.4 GiB for a minute, which at the end of the run came on top of
every session's systems and engines (the default run peaked at 22.4 of the machine's 24 GiB)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests under tests/integration and tests/e2e get that marker, so `-m "not integration"` works; the
    FIRST files run first."""
    for item in items:
        try:
            rel = item.path.relative_to(_HERE)
        except ValueError:
            continue
        if rel.parts and rel.parts[0] in ("integration", "e2e"):
            item.add_marker(rel.parts[0])

    def first(item: pytest.Item) -> bool:
        try:
            return item.path.relative_to(_HERE).as_posix() in FIRST
        except ValueError:
            return False

    items[:] = sorted(items, key=lambda item: not first(item))  # stable: the rest keep their order


# --- real services, shared by integration and e2e tests ---
@pytest.fixture(scope="session")
def redis_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    data_dir: Path = tmp_path_factory.mktemp("redis")
    with start_redis(data_dir=data_dir) as service:
        yield service


@pytest.fixture(scope="session")
def redis_url(redis_service: RunningService) -> str:
    return redis_service.url


@pytest.fixture
def redis_client(redis_service: RunningService) -> Iterator[redis.Redis]:
    """A bytes client on the session Redis; its DB is flushed after the test."""
    client = redis.Redis.from_url(redis_service.url)
    try:
        yield client
    finally:
        if not redis_service.running:  # a test stopped the shared server: bring it back
            redis_service.restart()
        client.flushdb()
        client.close()


OUTBOX_DB = 13
"""A DB of the session Redis for tests that read the outbox themselves (tests/outbox.py): apart from DB 0,
where an API app that another test left running would take its entries with its relay."""


@pytest.fixture
def outbox_redis(redis_service: RunningService) -> Iterator[redis.Redis]:
    """A bytes client on OUTBOX_DB, empty before and after the test."""
    client = redis.Redis.from_url(f"redis://127.0.0.1:{redis_service.port}/{OUTBOX_DB}")
    client.flushdb()
    try:
        yield client
    finally:
        if not redis_service.running:
            redis_service.restart()
        client.flushdb()
        client.close()


@pytest.fixture(scope="session")
def s3_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    with start_moto_s3(log_dir=tmp_path_factory.mktemp("moto")) as service:
        yield service


@pytest.fixture(scope="session")
def s3_endpoint_url(s3_service: RunningService) -> str:
    return s3_service.url


def s3_test_settings(endpoint_url: str, **overrides: Any) -> Settings:
    """Settings for the s3 backend on a test endpoint (fake credentials, as moto accepts any)."""
    values: dict[str, Any] = {
        "artifact_backend": "s3",
        "s3_endpoint_url": endpoint_url,
        "s3_access_key_id": "testing",
        "s3_secret_access_key": "testing",
        "s3_region": "us-east-1",
    }
    return Settings(**(values | overrides))


@pytest.fixture
def s3_settings(s3_endpoint_url: str) -> Settings:
    """Settings pointing the s3 backend at the session moto endpoint, with a fresh bucket name."""
    return s3_test_settings(s3_endpoint_url, s3_bucket=f"test-{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def s3_client(s3_endpoint_url: str) -> Any:
    """A boto3 S3 client on the session moto endpoint, built as production builds it (thread-safe)."""
    return s3_client_from_settings(s3_test_settings(s3_endpoint_url), max_attempts=2)


# --- engines, loaded once per session for in-process tests ---
REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO / "var" / "models"
"""Tiny models are built here once (deterministically) and reused by every test and the demo."""


@pytest.fixture(scope="session")
def engine_cache() -> Any:
    """Real vLLM / diffusers engines for in-process tests (the same cache class the workers use)."""
    from omni_jobs.engines.pool import EnginePool

    return EnginePool(MODELS_DIR, kv_cache_bytes=256 * 2**20, max_model_len=512, device="cpu")
