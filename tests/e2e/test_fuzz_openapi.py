"""The OpenAPI spec, fuzzed with schemathesis (bounded), with every check ``schemathesis run
--checks all`` runs: no input makes the API answer 5xx, every status and body it answers is in the
spec, schema-valid requests are accepted and invalid ones refused, and an unknown resource is a
404. Authenticated, so the routes behind the key are reached; positive and negative cases both.

The app runs in-process over real Redis (its own DB) with no workers: fuzzed jobs are accepted
and wait on their queues instead of loading the e2e system's workers with random work.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS, load_all_checks

from api.main import create_app
from omni_jobs.auth import ApiKeys
from omni_jobs.local.devservices import RunningService
from omni_jobs.settings import Settings

FUZZ_DB = 9
MAX_EXAMPLES = 10  # per operation and mode: about 25 operations x 2 modes stays well under two minutes
KEY: dict[str, str] = {}


@pytest.fixture(scope="module")
def fuzz_schema(redis_service: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    url = f"redis://127.0.0.1:{redis_service.port}/{FUZZ_DB}"
    home = tmp_path_factory.mktemp("fuzz")
    # No webhook secret: a fuzzed webhook is refused before its host is resolved (random hosts, slow DNS).
    app = create_app(Settings(redis_url=url, artifacts_dir=home / "artifacts", models_dir=Path("var/models").resolve(),
                              openai_wait_s=0.2, max_prefer_wait_s=0.2))  # type: ignore[arg-type]
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


def not_a_server_error(ctx: object, response: schemathesis.Response, case: schemathesis.Case) -> bool:
    """schemathesis' own check, less the 5xx answers :func:`by_design` explains."""
    assert response.status_code < 500 or by_design(case, response.status_code, response.text), (
        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}")
    return True


SUBMIT_PATHS = ("/v1/jobs", "/v1/jobs/multipart")
SETTING_DEPENDENT = {"unsafe_url", "webhooks_disabled"}  # the webhook host's addresses (DNS), the signing secret
CHOSEN_PIPELINE_CODES = {"unsupported_parameter", "unsupported_modality", "unsupported_pipeline"}


def depends_on_the_pipeline(case: schemathesis.Case, response: schemathesis.Response) -> bool:
    """A schema-valid request refused for what the chosen pipeline takes: a job's ``input`` and
    ``params`` are checked against the pipeline's inputs and stages' parameter models (GET
    /v1/pipelines/{name} describes them; the spec does not, it has one JobRequest for all), and the
    OpenAI routes map their fields onto the stages of the pipeline they pick (400 with a ``code``:
    unsupported_* or the stage parameter's own error type). And Cancel-After above the
    OMNI_MAX_CANCEL_AFTER_S setting, which a pattern cannot say; a webhook host that resolves to a
    private address (DNS at submit time); the multipart form's JSON text fields (input, params,
    webhook_events_filter: OpenAPI types them as strings) and its input.<field> parts sent as text,
    not as files (OpenAPI cannot tell the two apart). Everything else must be accepted."""
    if case.path in SUBMIT_PATHS and response.status_code == 422:
        errors = response.json()["detail"]
        return all(list(e["loc"][:2]) in (["body", "input"], ["body", "params"])
                   or (e["loc"] == ["header", "Cancel-After"] and "must be between" in e["msg"])
                   or e["type"] in SETTING_DEPENDENT
                   or (case.path.endswith("/multipart") and (e["type"] in ("json_invalid", "type_error") or (
                       e["type"] == "extra" and str(e["loc"][-1]).startswith("input."))))
                   for e in errors)
    if case.path.startswith("/v1/") and response.status_code == 400:
        error = response.json().get("error") or {}
        code, param = error.get("code"), error.get("param") or ""
        return code in CHOSEN_PIPELINE_CODES or (code is not None and code != "unsupported_content") or (
            param.startswith("params"))
    return False


def positive_data_acceptance(ctx: object, response: schemathesis.Response, case: schemathesis.Case) -> bool | None:
    """schemathesis' check, less the refusals :func:`depends_on_the_pipeline` explains."""
    if depends_on_the_pipeline(case, response):
        return True
    return BUILTIN["positive_data_acceptance"](ctx, response, case)  # type: ignore[no-any-return]


BUILTIN: dict[str, Any] = {}


def all_checks() -> list[object]:
    """What ``--checks all`` runs: object_level_authorization needs a second identity's resources
    (tests/e2e/test_tenancy.py covers that); two are narrowed by the functions above."""
    load_all_checks()
    BUILTIN.update({c.__name__: c for c in CHECKS.get_all()})
    replaced = {"not_a_server_error": not_a_server_error, "positive_data_acceptance": positive_data_acceptance}
    kept = [c for name, c in BUILTIN.items() if name not in replaced and name != "object_level_authorization"]
    return kept + list(replaced.values())


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_check_passes(fuzz_schema: schemathesis.BaseSchema, mode: GenerationMode) -> None:
    headers = {"authorization": f"Bearer {KEY['value']}"}
    operations = [result.ok() for result in fuzz_schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 15  # jobs, events, pipelines, openai, health: the whole spec is reached
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
    assert failures == [], f"{len(failures)} operations failed:\n\n" + "\n\n".join(failures)


def test_an_event_id_past_redis_range_is_a_422(fuzz_schema: schemathesis.BaseSchema) -> None:
    """Found by ``schemathesis run``: a 20-digit id part can pass 2**64 - 1, which Redis refused in the
    middle of the stream (a cut answer); the spec and the route now take 19 digits at most."""
    operation = fuzz_schema["/v1/jobs/{job_id}/events"]["GET"]
    headers = {"authorization": f"Bearer {KEY['value']}"}
    for case in (operation.Case(path_parameters={"job_id": "job_x"}, headers={"Last-Event-ID": "34029841368171409130-378"}),
                 operation.Case(path_parameters={"job_id": "job_x"}, query={"after": "1-34029841368171409130"})):
        response = case.call(headers=headers)
        assert response.status_code == 422, response.text
