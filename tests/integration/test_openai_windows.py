"""The OpenAI routes' windows of issue 62, through the real app and Redis (no workers: jobs wait on their
queues): a model that does not exist is OpenAI's 404, not another pipeline's answer."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from omni_jobs.accept.auth import ApiKeys
from omni_jobs.core.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture
def api(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(redis_url=redis_url, artifacts_dir=tmp_path / "artifacts", models_dir=tmp_path / "models",
                        tenant_max_active=3)
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.fixture
def key(redis_client: redis.Redis) -> dict[str, str]:
    return {"authorization": f"Bearer {ApiKeys(redis_client).create('acme')[0]}"}


def test_an_unknown_model_is_openais_404_on_every_route(api: TestClient, key: dict[str, str]) -> None:
    clip = ("a.wav", io.BytesIO(b"RIFF"), "audio/wav")
    answers = [
        api.post("/v1/chat/completions", headers=key,
                 json={"model": "gpt-4o-typo", "messages": [{"role": "user", "content": "x"}]}),
        api.post("/v1/images/generations", headers=key, json={"model": "dall-e-9", "prompt": "a fox"}),
        api.post("/v1/audio/speech", headers=key, json={"model": "tts-9", "input": "hi"}),
        api.post("/v1/audio/transcriptions", headers=key, data={"model": "whisper-9"}, files={"file": clip}),
        api.post("/v1/audio/translations", headers=key, data={"model": "whisper-9"}, files={"file": clip}),
    ]
    for answer in answers:
        assert answer.status_code == 404, answer.text
        error = answer.json()["error"]
        assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert api.get("/v1/jobs", headers=key).json()["data"] == []  # nothing ran


def test_images_with_n_are_all_or_none(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    """A quota that holds some of the n images refuses them all (nothing runs, nothing is charged); n above
    the quota itself is a 400 naming n; with an Idempotency-Key a retry answers the same n jobs."""
    settings = Settings(redis_url=redis_url, artifacts_dir=tmp_path / "artifacts", models_dir=tmp_path / "models",
                        tenant_max_active=3, openai_wait_s=0.3)
    key = {"authorization": f"Bearer {ApiKeys(redis_client).create('acme')[0]}"}
    with TestClient(create_app(settings)) as api:
        first = api.post("/v1/jobs", headers=key, json={"pipeline": "text-to-text", "input": {"prompt": "x"}})
        assert first.status_code == 202, first.text
        refused = api.post("/v1/images/generations", headers=key, json={"prompt": "a fox", "n": 3, "size": "64x64"})
        assert refused.status_code == 429, refused.text
        assert "none of the 3 images was started" in refused.json()["error"]["message"]
        assert [job["id"] for job in api.get("/v1/jobs", headers=key).json()["data"]] == [first.json()["id"]]
        too_many = api.post("/v1/images/generations", headers=key, json={"prompt": "a fox", "n": 4})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n", too_many.text
        keyed = {**key, "Idempotency-Key": "fox-1"}
        made = api.post("/v1/images/generations", headers=keyed, json={"prompt": "a fox", "n": 2, "size": "64x64"})
        assert made.status_code == 504, made.text  # no workers: both wait, named
        ids = made.headers["x-omni-job-id"].split(",")
        assert len(set(ids)) == 2
        again = api.post("/v1/images/generations", headers=keyed, json={"prompt": "a fox", "n": 2, "size": "64x64"})
        assert again.headers["x-omni-job-id"].split(",") == ids  # the retry runs nothing new
        assert len(api.get("/v1/jobs", headers=key).json()["data"]) == 3
