"""The OpenAPI spec, fuzzed with schemathesis (bounded): no input makes the API answer 5xx, and
every response matches the schema. Authenticated, so the routes behind the key are reached.

The app runs in-process over real Redis (its own DB) with no workers: fuzzed jobs are accepted
and wait on their queues instead of loading the e2e system's workers with random work.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import response_schema_conformance

from api.main import create_app
from omni_jobs.auth import ApiKeys
from omni_jobs.local.devservices import RunningService
from omni_jobs.settings import Settings
from omni_jobs.webhooks import generate_secret

FUZZ_DB = 9
MAX_EXAMPLES = 15
KEY: dict[str, str] = {}


@pytest.fixture(scope="module")
def fuzz_schema(redis_service: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    url = f"redis://127.0.0.1:{redis_service.port}/{FUZZ_DB}"
    home = tmp_path_factory.mktemp("fuzz")
    app = create_app(Settings(redis_url=url, artifacts_dir=home / "artifacts", models_dir=Path("var/models").resolve(),
                              webhook_secret=generate_secret(), openai_wait_s=0.2, max_prefer_wait_s=0.2))  # type: ignore[arg-type]
    client = redis.Redis.from_url(url)
    KEY["value"] = ApiKeys(client).create("fuzz")[0]
    with TestClient(app):  # runs the lifespan: the app's context exists for the fuzzed calls
        yield schemathesis.openapi.from_asgi("/openapi.json", app)
    client.flushdb()
    client.close()


def by_design(case: schemathesis.Case, status: int, body: str) -> bool:
    """The 5xx answers that mean what they say with no workers running: not ready, job not done in time."""
    if case.path == "/readyz":
        return status == 503 and '"missing"' in body
    return status == 504 and "job_timeout" in body  # OpenAI routes: the job did not end within OMNI_OPENAI_WAIT_S


def test_no_5xx_and_responses_match_the_schema(fuzz_schema: schemathesis.BaseSchema) -> None:
    headers = {"authorization": f"Bearer {KEY['value']}"}
    operations = [result.ok() for result in fuzz_schema.get_all_operations()]
    assert len(operations) >= 15  # jobs, events, pipelines, openai, health: the whole spec is reached
    failures: list[str] = []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case: schemathesis.Case) -> None:
            response = case.call(headers=headers)
            case.validate_response(response, checks=[response_schema_conformance])
            assert response.status_code < 500 or by_design(case, response.status_code, response.text), (
                f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}")

        try:
            run()
        except Exception as exc:  # noqa: BLE001 - collect every operation's failure, then report them all
            failures.append(f"{operation.label}: {exc}"[:2000])
    assert failures == [], "\n\n".join(failures)
