"""A submit with file inputs that is refused leaves no file behind (issue 62): a file input is decoded and
stored before the submit's write checks the tenant's quotas, the key's revocation and its Idempotency-Key;
a refused write wrote no job, so nothing would ever delete those files (a 16 MiB JPEG is ~48 MiB of PNG,
left for every 429). Real app, real Redis, local artifact store (a directory we can list)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from PIL import Image

from api.main import create_app
from omni_jobs.accept.auth import ApiKeys
from omni_jobs.core.settings import Settings
from omni_jobs.jobs.flows import Idempotency

pytestmark = pytest.mark.integration


def image_body(seed: int) -> dict[str, object]:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (seed % 256, 40, 90)).save(buf, format="JPEG")
    return {"pipeline": "image-to-image",
            "input": {"prompt": "x", "image": "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()}}


def stored_inputs(root: Path) -> set[str]:
    """The job ids that have input files in the local artifact store."""
    return {p.parent.parent.name for p in root.rglob("inputs/*") if p.is_file()}


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    return tmp_path / "artifacts"


@pytest.fixture
def api(redis_url: str, redis_client: redis.Redis, artifacts: Path, tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(redis_url=redis_url, artifacts_dir=artifacts, models_dir=tmp_path / "models",
                        tenant_max_active=1)
    with TestClient(create_app(settings)) as client:
        yield client


def test_a_submit_refused_by_a_quota_leaves_no_input_file(api: TestClient, redis_client: redis.Redis,
                                                          artifacts: Path) -> None:
    key = {"authorization": f"Bearer {ApiKeys(redis_client).create('acme')[0]}"}
    first = api.post("/v1/jobs", json=image_body(1), headers=key)
    assert first.status_code == 202, first.text
    assert stored_inputs(artifacts) == {first.json()["id"]}
    for seed in range(2, 5):
        refused = api.post("/v1/jobs", json=image_body(seed), headers=key)
        assert refused.status_code == 429 and refused.json()["limit"] == "max_active"
    jpeg = base64.b64decode(str(image_body(9)["input"]["image"]).split(",", 1)[1])  # type: ignore[index]
    form = {"pipeline": "image-to-image", "input": '{"prompt": "x"}'}
    multipart = api.post("/v1/jobs/multipart", headers=key, data=form,
                         files={"input.image": ("a.jpg", jpeg, "image/jpeg")})
    assert multipart.status_code == 429
    assert stored_inputs(artifacts) == {first.json()["id"]}


def test_a_submit_refused_for_a_revoked_key_leaves_no_input_file(api: TestClient, redis_client: redis.Redis,
                                                                 artifacts: Path) -> None:
    keys = ApiKeys(redis_client)
    secret, info = keys.create("acme")
    key = {"authorization": f"Bearer {secret}"}
    accepted = api.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "x"}}, headers=key)
    assert accepted.status_code == 202
    keys.revoke(info.id)  # the API's key cache still has it: the write's own guard refuses the submit
    refused = api.post("/v1/jobs", json=image_body(1), headers=key)
    assert refused.status_code == 401, refused.text
    assert stored_inputs(artifacts) == set()


def test_an_idempotent_replay_that_races_its_first_request_leaves_no_input_file(
        api: TestClient, redis_client: redis.Redis, artifacts: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests with one Idempotency-Key at once: both find no record before the write, both store
    their files, and the second write finds the first's record (a replay). Its files must go."""
    key = {"authorization": f"Bearer {ApiKeys(redis_client).create('acme')[0]}", "idempotency-key": "race"}
    first = api.post("/v1/jobs", json=image_body(1), headers=key)
    ctx = api.app.state.ctx  # type: ignore[attr-defined]

    store = ctx.runtime.store
    real, reads = store.arun, []

    async def not_yet(op: object) -> object:  # its read before the write came before the first's write
        if isinstance(op, Idempotency):
            reads.append(op.key)
            if len(reads) == 1:
                return None
        return await real(op)

    monkeypatch.setattr(store, "arun", not_yet)
    replay = api.post("/v1/jobs", json=image_body(1), headers=key)
    assert replay.status_code == 202 and replay.json()["id"] == first.json()["id"]
    assert replay.headers["idempotent-replayed"] == "true"
    assert stored_inputs(artifacts) == {first.json()["id"]}
