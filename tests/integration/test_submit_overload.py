"""Admission through the real app: a full entry queue answers 503 from inside the submit's write,
and a job with an image input is refused before its file is stored (real Redis, no workers)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from PIL import Image

from api.main import create_app
from omni_jobs.accept.auth import ApiKeys
from omni_jobs.core.settings import Settings

pytestmark = pytest.mark.integration


def test_a_full_entry_queue_answers_503_and_stores_no_input_file(redis_url: str, redis_client: redis.Redis,
                                                                  tmp_path: Path) -> None:
    settings = Settings(redis_url=redis_url, artifacts_dir=tmp_path / "artifacts", models_dir=tmp_path / "models",
                        max_queued_per_queue=1, overload_retry_after_s=7)
    key, _ = ApiKeys(redis_client).create("acme")
    auth = {"authorization": f"Bearer {key}"}
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buf, format="PNG")
    image = {"pipeline": "image-to-image",
             "input": {"prompt": "blue", "image": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}
    text = {"pipeline": "text-to-text", "input": {"prompt": "hello"}}
    with TestClient(create_app(settings)) as client:
        for body in (text, image):
            assert client.post("/v1/jobs", json=body, headers=auth).status_code == 202
            full = client.post("/v1/jobs", json=body, headers=auth)
            assert full.status_code == 503 and full.headers["retry-after"] == "7", full.text
            assert "is full (1 waiting, limit 1)" in full.json()["detail"]
        assert len(client.get("/v1/jobs", headers=auth).json()["data"]) == 2
    stored = [p for p in (tmp_path / "artifacts").rglob("*") if p.is_file()]
    assert len(stored) == 1, stored  # the accepted image job's input only
