"""A corpus of malformed image, audio and video files against every upload path gives no 5xx (issue 62,
item 3): empty, random, another format, cut short, overwritten at random, or lying in their headers
(tests.media_files.malformed_corpus, made here, nothing binary committed).

First the core that decodes them (omni_jobs.media.input_files, omni_jobs.media.decode): each file is refused with an
InvalidRequest naming the field, or taken (a damaged file can still decode), never another error. Then
each upload path of the real app, on real Redis with no workers (an accepted job just waits): JSON with
base64, the multipart form, the console's playground, and the OpenAI routes that take files.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from fastapi.testclient import TestClient

from api.main import create_app
from omni_jobs.accept.auth import ApiKeys
from omni_jobs.artifacts import ArtifactStore, LocalBackend
from omni_jobs.core.errors import InvalidRequest
from omni_jobs.core.settings import Settings
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.media.input_files import InputFiles
from omni_jobs.pipelines.catalogue import PipelineCatalogue, load_catalogue
from omni_jobs.pipelines.limits import Limits
from tests.media_files import MEDIA_PIPELINE, malformed_corpus

pytestmark = pytest.mark.integration

CORPUS = malformed_corpus()
TARGETS = {"image": ("image-to-image", "image", "image/png"), "audio": ("media-inputs", "speech", "audio/wav"),
           "video": ("media-inputs", "clip", "video/mp4")}
"""File type -> (pipeline, its input of that type, the media type the file claims to be)."""
CASES = [(kind, name) for kind, files in CORPUS.items() for name in files]
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder: Path = tmp_path_factory.mktemp("pipelines")
    (folder / "media-inputs.yaml").write_text(yaml.safe_dump(MEDIA_PIPELINE))
    return folder


@pytest.fixture(scope="module")
def catalogue(pipelines: Path) -> PipelineCatalogue:
    return load_catalogue([pipelines])


def test_the_core_refuses_each_malformed_file_by_its_field_or_takes_it(catalogue: PipelineCatalogue,
                                                                       tmp_path: Path) -> None:
    files = InputFiles(ArtifactStore(LocalBackend(tmp_path)), MemoryJobStore(), limits=Limits.from_settings(Settings()))
    taken: list[str] = []
    for kind, name in CASES:
        pipeline, field, _media = TARGETS[kind]
        try:
            files.prepare(catalogue.get(pipeline), {"prompt": "x", field: CORPUS[kind][name]}, tenant="acme")
        except InvalidRequest as exc:
            assert [e.loc for e in exc.errors] == [("input", field)], (kind, name, exc.errors)
            assert exc.errors[0].type == f"invalid_{kind}", (kind, name, exc.errors)
        else:
            taken.append(f"{kind}/{name}")
    # what still decodes is a usable file after all (a damaged MP3 plays what it holds): few of them
    assert len(taken) < len(CASES) // 4, taken


@pytest.fixture(scope="module")
def app(pipelines: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("malformed")
    settings = Settings(redis_url=redis_url, artifacts_dir=root / "artifacts", models_dir=root / "models",
                        pipelines_path=[pipelines], openai_wait_s=0.05, tenant_max_active=0)
    yield create_app(settings)


@pytest.fixture(scope="module")
def api(app: Any, redis_url: str) -> Iterator[TestClient]:
    client = redis.Redis.from_url(redis_url)
    key = ApiKeys(client).create("malformed", "corpus")[0]
    with TestClient(app, raise_server_exceptions=False, follow_redirects=False,
                    headers={"authorization": f"Bearer {key}"}) as test_client:
        test_client.headers["x-key"] = key
        yield test_client
    client.flushdb()
    client.close()


def no_5xx(response: Any, what: str) -> None:
    """A 4xx, or the answer of an accepted job (a damaged file that still decodes); an OpenAI call whose
    job is accepted answers 504 job_timeout here, by design (no worker runs: OMNI_OPENAI_WAIT_S)."""
    if response.status_code == 504 and "job_timeout" in response.text:
        return
    assert response.status_code < 500, (what, response.status_code, response.text[:500])
    assert response.status_code not in (401, 403, 404), (what, "never reached the file", response.text[:300])


@pytest.mark.parametrize(("kind", "name"), CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_every_upload_path_answers_a_malformed_file_with_no_5xx(api: TestClient, kind: str, name: str) -> None:
    data = CORPUS[kind][name]
    pipeline, field, media_type = TARGETS[kind]
    uri = f"data:{media_type};base64,{base64.b64encode(data).decode()}"
    no_5xx(api.post("/v1/jobs", json={"pipeline": pipeline, "input": {"prompt": "x", field: uri}}), "json")
    no_5xx(api.post("/v1/jobs", json={"pipeline": pipeline, "input": {"prompt": "x", field: {
        "data": base64.b64encode(data).decode()}}}), "json {data}")
    no_5xx(api.post("/v1/jobs/multipart", data={"pipeline": pipeline, "input": json.dumps({"prompt": "x"})},
                    files={f"input.{field}": (f"file.{kind}", data, media_type)}), "multipart")
    # the console's playground (signed in with the same key)
    with TestClient(api.app, raise_server_exceptions=False, follow_redirects=False) as console:
        token = CSRF.search(console.get("/ui/login").text)
        assert token
        assert console.post("/ui/login", data={"api_key": api.headers["x-key"], "csrf_token": token.group(1)}
                            ).status_code == 303
        token = CSRF.search(console.get(f"/ui/pipelines/{pipeline}").text)
        assert token
        no_5xx(console.post(f"/ui/pipelines/{pipeline}", data={"csrf_token": token.group(1), "input.prompt": "x",
                                                                "submission": f"corpus-{kind}-{name}"[:64]},
                            files={f"input.{field}": (f"file.{kind}", data, media_type)}), "console")
    # the OpenAI routes that take files
    b64 = base64.b64encode(data).decode()
    part = {"image": {"type": "image_url", "image_url": {"url": uri}},
            "audio": {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
            "video": {"type": "video_url", "video_url": {"url": uri}}}[kind]
    model = "image-to-text" if kind == "image" else "omni-understanding"
    no_5xx(api.post("/v1/chat/completions", json={"model": model, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is it?"}, part]}]}), "openai chat")
    if kind == "audio":
        no_5xx(api.post("/v1/audio/transcriptions", data={"model": "speech-to-text"},
                        files={"file": ("file.wav", data, media_type)}), "openai transcription")
