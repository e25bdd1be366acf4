"""The OpenAPI spec, fuzzed with schemathesis (bounded), with every check ``schemathesis run
--checks all`` runs: no input makes the API answer 5xx, every status and body it answers is in the
spec, schema-valid requests are accepted and invalid ones refused, and an unknown resource is a
404. Authenticated, so the routes behind the key are reached; positive and negative cases both.
What is excused, and why, is tests/e2e/fuzz_hooks.py, which the CLI run loads too (docs/api/jobs.md).

The app runs in-process over real Redis (its own DB) with no workers: fuzzed jobs are accepted
and wait on their queues instead of loading the e2e system's workers with random work.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import schemathesis
import yaml
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS, load_all_checks

from api.main import create_app
from omni_jobs.accept.auth import ApiKeys
from omni_jobs.core.settings import Settings
from omni_jobs.local.devservices import RunningService
from tests.e2e import fuzz_hooks  # noqa: F401 - registers the filter_failure hook
from tests.media_files import MEDIA_PIPELINE

FUZZ_DB = 9
MEDIA_DB = 10
MAX_EXAMPLES = 10  # per operation and mode: about 25 operations x 2 modes stays well under two minutes
KEY: dict[str, str] = {}
SUBMITS = ("POST /v1/jobs", "POST /v1/jobs/multipart")


def fuzzed_app(port: int, db: int, home: Path, **settings_: object) -> Iterator[schemathesis.BaseSchema]:
    """The app over its own Redis DB, with a key for the fuzzed calls (KEY[db]); flushed afterwards."""
    url = f"redis://127.0.0.1:{port}/{db}"
    # No webhook secret: a fuzzed webhook is refused before its host is resolved (random hosts, slow DNS).
    app = create_app(Settings(redis_url=url, artifacts_dir=home / "artifacts", models_dir=Path("var/models").resolve(),
                              openai_wait_s=0.2, max_prefer_wait_s=0.2, **settings_))  # type: ignore[arg-type]
    client = redis.Redis.from_url(url)
    KEY[str(db)] = ApiKeys(client).create("fuzz")[0]
    with TestClient(app):  # runs the lifespan: the app's context exists for the fuzzed calls
        yield schemathesis.openapi.from_asgi("/openapi.json", app)
    client.flushdb()
    client.close()


@pytest.fixture(scope="module")
def fuzz_schema(redis_service: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    yield from fuzzed_app(redis_service.port, FUZZ_DB, tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="module")
def media_schema(redis_service: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The app with a pipeline of audio and video inputs too (tests/media_files.MEDIA_PIPELINE)."""
    home = tmp_path_factory.mktemp("fuzz-media")
    (home / "pipelines").mkdir()
    (home / "pipelines" / "media-inputs.yaml").write_text(yaml.safe_dump(MEDIA_PIPELINE))
    yield from fuzzed_app(redis_service.port, MEDIA_DB, home, pipelines_path=[home / "pipelines"])


def all_checks() -> list[object]:
    """What ``--checks all`` runs, but object_level_authorization: it needs a second identity's
    resources (tests/e2e/test_tenancy.py covers that). Their failures pass fuzz_hooks.filter_failure
    (registered when this module imported it), as in ``schemathesis run`` with that hooks module."""
    load_all_checks()
    return [check for check in CHECKS.get_all() if check.__name__ != "object_level_authorization"]


def failures_of(schema: schemathesis.BaseSchema, mode: GenerationMode, db: int, only: tuple[str, ...] = ()) -> list[str]:
    """Every check on every operation (or those named in ``only``): what failed, one line each."""
    headers = {"authorization": f"Bearer {KEY[str(db)]}"}
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    operations = [op for op in operations if not only or op.label in only]
    assert len(operations) >= (len(only) or 15)  # jobs, events, pipelines, openai, health: the whole spec is reached
    checks = all_checks()
    failures: list[str] = []
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case: schemathesis.Case) -> None:
            response = case.call(headers=headers)
            case.validate_response(response, checks=checks, headers=headers)  # type: ignore[arg-type]

        try:
            run()
        except Unsatisfiable:  # nothing to negate: no parameter, no body (/healthz, /metrics)
            assert mode is GenerationMode.NEGATIVE and not operation.body and not list(operation.iter_parameters())
        except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - collect every failure, report them all
            failures.append(f"{operation.label}: {exc}"[:int(os.environ.get("FUZZ_REPORT_CHARS", "1500"))])
    return failures


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_check_passes(fuzz_schema: schemathesis.BaseSchema, mode: GenerationMode) -> None:
    failures = failures_of(fuzz_schema, mode, FUZZ_DB)
    assert failures == [], f"{len(failures)} operations failed:\n\n" + "\n\n".join(failures)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_submits_with_audio_and_video_inputs(media_schema: schemathesis.BaseSchema, mode: GenerationMode) -> None:
    """The two submit routes where a pipeline has two file inputs, an audio and a video (as JSON and as
    form parts): what the schema allows is accepted, or refused only because the bytes do not decode."""
    failures = failures_of(media_schema, mode, MEDIA_DB, SUBMITS)
    assert failures == [], f"{len(failures)} operations failed:\n\n" + "\n\n".join(failures)


def test_an_event_id_past_redis_range_is_a_422(fuzz_schema: schemathesis.BaseSchema) -> None:
    """Found by ``schemathesis run``: a 20-digit id part can pass 2**64 - 1, which Redis refused in the
    middle of the stream (a cut answer); the spec and the route now take 19 digits at most."""
    operation = fuzz_schema["/v1/jobs/{job_id}/events"]["GET"]
    headers = {"authorization": f"Bearer {KEY[str(FUZZ_DB)]}"}
    for case in (operation.Case(path_parameters={"job_id": "job_x"}, headers={"Last-Event-ID": "34029841368171409130-378"}),
                 operation.Case(path_parameters={"job_id": "job_x"}, query={"after": "1-34029841368171409130"})):
        response = case.call(headers=headers)
        assert response.status_code == 422, response.text
