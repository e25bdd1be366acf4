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
from omni_jobs.auth import ApiKeys
from omni_jobs.settings import Settings

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
