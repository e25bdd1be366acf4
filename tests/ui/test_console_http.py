"""The console's rules over HTTP, through the real app and real Redis (no browser, no workers needed:
submitted jobs just wait on their queues). Sign-in, cookies, CSRF, tenancy, redirects, headers,
the playground's validation, paging with filters, and the job page's live stream."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from fastapi.testclient import TestClient
from pydantic import SecretStr

from api.main import create_app
from omni_jobs.accept.auth import ApiKeys
from omni_jobs.core.keys import job_events as job_events_key
from omni_jobs.core.settings import Settings
from omni_jobs.report.webhooks import generate_secret
from tests import media_files as mf

pytestmark = [pytest.mark.ui, pytest.mark.integration]

HTML = {"accept": "text/html,application/xhtml+xml"}
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
MISSING = "job_000000000000000000000000"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def settings(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, artifacts_dir=tmp_path / "artifacts", models_dir=tmp_path / "models")


@pytest.fixture
def app(settings: Settings) -> Any:
    return create_app(settings)


@pytest.fixture
def keys(redis_client: redis.Redis) -> dict[str, str]:
    store = ApiKeys(redis_client)
    return {"acme": store.create("acme", "ui")[0], "other": store.create("other", "ui")[0]}


@pytest.fixture
def anonymous(app: Any) -> Iterator[TestClient]:
    with TestClient(app, follow_redirects=False) as client:
        yield client


def csrf_of(client: TestClient, path: str = "/ui/login") -> str:
    match = CSRF.search(client.get(path, headers=HTML).text)
    assert match, f"no CSRF token on {path}"
    return match.group(1)


def signed_in(app: Any, key: str) -> TestClient:
    client = TestClient(app, follow_redirects=False)
    client.__enter__()
    token = csrf_of(client)
    response = client.post("/ui/login", data={"api_key": key, "csrf_token": token, "next": "/ui/jobs"})
    assert response.status_code == 303 and response.headers["location"] == "/ui/jobs", response.text
    return client


@pytest.fixture
def acme(app: Any, keys: dict[str, str]) -> Iterator[TestClient]:
    client = signed_in(app, keys["acme"])
    yield client
    client.__exit__(None, None, None)


@pytest.fixture
def other(app: Any, keys: dict[str, str]) -> Iterator[TestClient]:
    client = signed_in(app, keys["other"])
    yield client
    client.__exit__(None, None, None)


def submit(client: TestClient, pipeline: str = "text-to-text", **fields: str) -> Any:
    token = csrf_of(client, f"/ui/pipelines/{pipeline}")
    data = {"csrf_token": token, "input.prompt": "hello", "submission": secrets.token_hex(8), **fields}
    return client.post(f"/ui/pipelines/{pipeline}", data=data, files={"_": ("", b"")})


def test_pages_ask_to_sign_in_and_come_back(anonymous: TestClient, keys: dict[str, str]) -> None:
    response = anonymous.get("/ui/jobs?status=running", headers=HTML)
    assert response.status_code == 303
    assert response.headers["location"] == "/ui/login?next=%2Fui%2Fjobs%3Fstatus%3Drunning"
    for path in ("/ui/jobs/stream", f"/ui/jobs/{MISSING}/stream", f"/ui/jobs/{MISSING}/outputs/image"):
        assert anonymous.get(path).status_code == 401, path  # streams and files: no redirect to a page
    token = csrf_of(anonymous, "/ui/login?next=/ui/jobs%3Fstatus%3Drunning")
    response = anonymous.post("/ui/login", data={"api_key": keys["acme"], "csrf_token": token,
                                                 "next": "/ui/jobs?status=running"})
    assert response.status_code == 303 and response.headers["location"] == "/ui/jobs?status=running"


def test_the_session_cookie_is_set_safely(app: Any, keys: dict[str, str]) -> None:
    for base, secure in (("http://testserver", False), ("https://testserver", True)):
        with TestClient(app, base_url=base, follow_redirects=False) as client:
            token = csrf_of(client)
            response = client.post("/ui/login", data={"api_key": keys["acme"], "csrf_token": token})
            cookies = {c.split("=", 1)[0]: c for c in response.headers.get_list("set-cookie")}
            session = cookies["omni_ui_session"]
            assert "HttpOnly" in session and "SameSite=strict" in session and "Path=/ui" in session
            assert ("Secure" in session) is secure
            assert keys["acme"] not in response.headers["location"]
            assert cookies["omni_ui_csrf"].split(";")[0] != f"omni_ui_csrf={token}", "a new CSRF token at sign-in"
            page = client.get("/ui/jobs", headers=HTML)
            assert page.status_code == 200 and keys["acme"] not in page.text
            assert "script-src 'self'" in page.headers["content-security-policy"]
            assert page.headers["cache-control"] == "no-store" and page.headers["x-frame-options"] == "DENY"


def test_a_wrong_or_revoked_key_does_not_sign_in(anonymous: TestClient, app: Any, keys: dict[str, str],
                                                 redis_client: redis.Redis) -> None:
    token = csrf_of(anonymous)
    for key in ("", "nonsense", "ok_0123456789abcdef_" + "A" * 43, keys["acme"][:-2] + "zz"):
        response = anonymous.post("/ui/login", data={"api_key": key, "csrf_token": token})
        assert response.status_code == 401 and "omni_ui_session" not in response.headers.get("set-cookie", "")
        assert 'class="field-error"' in response.text
    client = signed_in(app, keys["acme"])
    try:
        assert client.get("/ui/jobs", headers=HTML).status_code == 200
        store = ApiKeys(redis_client)
        store.revoke(next(i.id for i in store.list() if i.tenant == "acme"))
        response = client.get("/ui/jobs", headers=HTML)
        assert response.status_code == 303 and response.headers["location"].startswith("/ui/login")
    finally:
        client.__exit__(None, None, None)


def test_forms_without_their_csrf_token_or_from_another_site_are_refused(acme: TestClient) -> None:
    token = csrf_of(acme, "/ui/pipelines/text-to-text")
    form = {"input.prompt": "hello", "submission": "csrf-test-1"}
    for data, headers in (
            (form, {}),                                                    # no token
            ({**form, "csrf_token": "forged"}, {}),                        # a wrong one
            ({**form, "csrf_token": token}, {"origin": "https://evil.example"}),  # right token, another site
            ({**form, "csrf_token": token}, {"origin": "null"})):
        response = acme.post("/ui/pipelines/text-to-text", data=data, headers=headers, files={"_": ("", b"")})
        assert response.status_code == 403, (data, headers)
    assert acme.post("/ui/logout", data={}).status_code == 403
    assert acme.post(f"/ui/jobs/{MISSING}/cancel", data={"csrf_token": "x"}).status_code == 403
    assert 'data-job-id=' not in acme.get("/ui/jobs", headers=HTML).text, "no job was made"
    ok = acme.post("/ui/pipelines/text-to-text", data={**form, "csrf_token": token},
                   headers={"origin": "http://testserver"}, files={"_": ("", b"")})
    assert ok.status_code == 303 and ok.headers["location"].startswith("/ui/jobs/job_")


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/", "/v1/jobs", "/ui\\..\\x",
                                    "/ui/login?next=/ui/jobs", "javascript:alert(1)"])
def test_sign_in_never_redirects_off_the_console(anonymous: TestClient, keys: dict[str, str], target: str) -> None:
    token = csrf_of(anonymous)
    response = anonymous.post("/ui/login", data={"api_key": keys["acme"], "csrf_token": token, "next": target})
    assert response.headers["location"] == "/ui/jobs"


def test_submit_then_the_job_page_then_cancel(acme: TestClient) -> None:
    response = submit(acme, "text-to-image", **{"params.dit.height": "32", "params.ar.max_tokens": "3"})
    assert response.status_code == 303
    job_page = response.headers["location"]
    page = acme.get(job_page, headers=HTML)
    assert page.status_code == 200
    assert 'data-status="queued"' in page.text and 'id="cancel-job"' in page.text
    assert "height=32" in page.text and "max_tokens=3" in page.text  # the recorded params
    assert "width=64" in page.text  # defaults the form left alone still apply
    job_id = job_page.rsplit("/", 1)[1]
    assert f'data-job-id="{job_id}"' in acme.get("/ui/jobs", headers=HTML).text
    token = CSRF.search(page.text).group(1)  # type: ignore[union-attr]
    response = acme.post(f"{job_page}/cancel", data={"csrf_token": token})
    assert response.status_code == 303 and response.headers["location"] == f"{job_page}?notice=canceled"
    page = acme.get(response.headers["location"], headers=HTML)
    assert 'data-status="canceled"' in page.text and "The job was canceled." in page.text
    assert 'id="cancel-job"' not in page.text
    again = acme.post(f"{job_page}/cancel", data={"csrf_token": token})
    assert again.headers["location"].endswith("notice=already-finished")


def test_a_finished_jobs_page_follows_its_webhooks_until_the_last_is_answered(settings: Settings,
                                                                             keys: dict[str, str]) -> None:
    """Webhooks are delivered after the job ends: a page opened on a finished job must still follow them
    (CI once saw a page stay at "No delivery attempt yet" while the receiver had every event)."""
    acme = signed_in(create_app(settings.model_copy(update={"webhook_secret": SecretStr(generate_secret()), "webhook_allow_hosts": ["127.0.0.1"]})), keys["acme"])
    try:
        def finished_page(**fields: str) -> tuple[str, str]:
            response = submit(acme, "text-to-text", **fields)
            assert response.status_code == 303, field_errors(response.text)
            job_page = response.headers["location"]
            token = CSRF.search(acme.get(job_page, headers=HTML).text).group(1)  # type: ignore[union-attr]
            acme.post(f"{job_page}/cancel", data={"csrf_token": token})
            return job_page.rsplit("/", 1)[1], acme.get(job_page, headers=HTML).text

        job_id, page = finished_page(webhook="http://127.0.0.1:9/hook")
        assert 'data-status="canceled"' in page
        assert f'data-job-stream="/ui/jobs/{job_id}/stream"' in page  # its webhook's deliveries are still to come
        _, page = finished_page()
        assert 'data-status="canceled"' in page and 'data-job-stream=""' in page  # nothing more will change
    finally:
        acme.__exit__(None, None, None)  # the app's lifespan: its outbox relay stops


def test_a_double_submit_makes_one_job(acme: TestClient) -> None:
    token = csrf_of(acme, "/ui/pipelines/text-to-text")
    data = {"csrf_token": token, "input.prompt": "once", "submission": "same-form-0001"}
    first = acme.post("/ui/pipelines/text-to-text", data=data, files={"_": ("", b"")})
    second = acme.post("/ui/pipelines/text-to-text", data=data, files={"_": ("", b"")})
    assert first.headers["location"] == second.headers["location"]
    changed = acme.post("/ui/pipelines/text-to-text", data={**data, "input.prompt": "twice"}, files={"_": ("", b"")})
    assert changed.status_code == 409 and "already used to submit job" in changed.text


def field_errors(html: str) -> dict[str, str]:
    return dict(re.findall(r'id="f-([a-z0-9-]+)-error" role="alert">([^<]+)<', html))


def test_errors_land_beside_their_fields(acme: TestClient) -> None:
    # The core's validation names each bad field; the page puts each message beside its field.
    response = submit(acme, "text-to-image", **{"input.prompt": "", "params.dit.height": "100",
                                                "params.ar.temperature": "9", "params.dit.seed": "7"})
    assert response.status_code == 422
    errors = field_errors(response.text)
    assert set(errors) == {"input-prompt", "params-dit-height", "params-ar-temperature"}, errors
    assert "must not be empty" in errors["input-prompt"]
    assert "multiple of 8" in errors["params-dit-height"]
    assert "less than or equal to 2" in errors["params-ar-temperature"]
    assert 'aria-invalid="true"' in response.text
    # What was typed comes back as typed.
    assert 'name="params.dit.height" type="number" value="100"' in response.text
    assert 'name="params.dit.seed" type="number" value="7"' in response.text
    # A value that is not a number at all is caught before the core is asked.
    response = submit(acme, "text-to-image", **{"params.dit.width": "abc"})
    assert field_errors(response.text) == {"params-dit-width": "must be a whole number"}
    # Options too: cancel-after out of range is named beside the option.
    response = submit(acme, "text-to-text", cancel_after="-5")
    assert response.status_code == 422 and set(field_errors(response.text)) == {"cancel-after"}
    # A stage-wide rule (image-to-image: strength x steps >= 1) is shown on the stage's fieldset.
    response = submit(acme, "image-to-image", **{"params.dit.strength": "0.1", "params.dit.num_inference_steps": "2"})
    assert re.search(r'id="f-params-dit-error" role="alert">[^<]*leaves no denoising step', response.text)
    assert "data-job-id=" not in acme.get("/ui/jobs", headers=HTML).text, "no job was made"


def test_audio_and_video_uploads_are_played_back_on_the_job_page(settings: Settings, keys: dict[str, str],
                                                                tmp_path: Path) -> None:
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "media-inputs.yaml").write_text(yaml.safe_dump(mf.MEDIA_PIPELINE))
    app = create_app(settings.model_copy(update={"pipelines_path": [folder]}))
    acme, other = signed_in(app, keys["acme"]), signed_in(app, keys["other"])
    try:
        form = acme.get("/ui/pipelines/media-inputs", headers=HTML).text
        assert 'name="input.speech" type="file" accept="audio/*"' in form
        assert 'name="input.clip" type="file" accept="video/*"' in form
        assert '<audio id="f-input-speech-preview"' in form and '<video id="f-input-clip-preview"' in form
        token = csrf_of(acme, "/ui/pipelines/media-inputs")
        fields = {"csrf_token": token, "input.prompt": "hello", "submission": secrets.token_hex(8)}
        wav, video = mf.wav(0.5), mf.mp4()
        response = acme.post("/ui/pipelines/media-inputs", data=fields, files={
            "input.speech": ("speech.wav", wav, "audio/wav"), "input.clip": ("clip.mp4", video, "video/mp4")})
        assert response.status_code == 303, field_errors(response.text)
        job_page = response.headers["location"]
        page = acme.get(job_page, headers=HTML).text
        assert f'<audio controls preload="metadata" src="{job_page}/inputs/speech">' in page
        assert f'<video controls preload="metadata" src="{job_page}/inputs/clip" width="48" height="32">' in page
        assert "12 frames at 12.0 fps" in page and "16000 Hz" in page
        stored = acme.get(f"{job_page}/inputs/speech")
        assert stored.status_code == 200 and stored.headers["content-type"] == "audio/wav" and stored.content == wav
        part = acme.get(f"{job_page}/inputs/clip", headers={"range": "bytes=0-99"})
        assert part.status_code == 206 and part.content == video[:100]  # H.264 already: copied, by the same muxer
        assert acme.get(f"{job_page}/inputs/prompt").status_code == 404  # not a file
        assert other.get(f"{job_page}/inputs/speech").status_code == 404  # another tenant's
        # A bad file: its error beside its field, and no job.
        fields["submission"] = secrets.token_hex(8)
        response = acme.post("/ui/pipelines/media-inputs", data=fields,
                             files={"input.speech": ("notes.wav", b"just text\n" * 40, "audio/wav")})
        assert response.status_code == 422
        assert "is not audio FFmpeg can read" in field_errors(response.text)["input-speech"]
    finally:
        acme.__exit__(None, None, None)
        other.__exit__(None, None, None)


def test_another_tenants_jobs_are_404_and_unlisted(acme: TestClient, other: TestClient) -> None:
    job_page = submit(acme).headers["location"]
    job_id = job_page.rsplit("/", 1)[1]
    theirs = other.get(job_page, headers=HTML)
    unknown = other.get(f"/ui/jobs/{MISSING}", headers=HTML)
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.text.replace(job_id, MISSING) == unknown.text.replace(CSRF.search(unknown.text).group(1),  # type: ignore[union-attr]
                                                                       CSRF.search(theirs.text).group(1))  # type: ignore[union-attr]
    for path in (f"{job_page}/stream", f"{job_page}/outputs/text"):
        assert other.get(path).status_code == 404
    token = csrf_of(other, "/ui/jobs")
    assert other.post(f"{job_page}/cancel", data={"csrf_token": token}).status_code == 404
    assert job_id not in other.get("/ui/jobs", headers=HTML).text
    assert 'data-status="queued"' in acme.get(job_page, headers=HTML).text, "untouched by the other tenant"
    form = other.get(f"/ui/pipelines/text-to-text?from={job_id}", headers=HTML)
    assert form.status_code == 200 and "Filled in from job" not in form.text


def test_paging_with_a_pipeline_filter_reads_on_through_the_core_pages(acme: TestClient) -> None:
    made: list[tuple[str, str]] = []
    for index in range(23):
        pipeline = "text-to-audio" if index % 4 == 0 else "text-to-text"
        made.append((pipeline, submit(acme, pipeline).headers["location"].rsplit("/", 1)[1]))
    newest_first = list(reversed(made))
    for pipeline, limit in (("text-to-audio", 10), ("text-to-text", 10), ("", 25), ("", 10)):
        seen: list[str] = []
        url: str | None = f"/ui/jobs?pipeline={pipeline}&limit={limit}"
        while url:
            page = acme.get(url, headers=HTML).text
            rows = re.findall(r'<tr data-job-id="(job_[0-9a-f]+)"', page)
            assert len(rows) <= limit
            seen += rows
            found = re.search(r'<a href="([^"]+)" rel="next"', page)
            url = found.group(1).replace("&amp;", "&") if found else None
        assert seen == [job for p, job in newest_first if p == pipeline or not pipeline], (pipeline, limit)
    statuses = acme.get("/ui/jobs?status=succeeded", headers=HTML).text
    assert "data-job-id=" not in statuses and "match these filters" in statuses


def read_events(lines: Iterator[str], until: str) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and name:
            events.append((name, json.loads(line[6:])))
            if name == until:
                return events
    return events


def test_the_job_page_stream_sends_fresh_sections_until_the_job_ends(acme: TestClient) -> None:
    job_page = submit(acme).headers["location"]
    token = csrf_of(acme, job_page)
    with acme.stream("GET", f"{job_page}/stream") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.iter_lines()
        first: list[str] = []
        for line in lines:
            first.append(line)
            if line.startswith("data: "):
                break
        snapshot = json.loads(first[-1][6:])
        assert snapshot["status"] == "queued" and not snapshot["final"]
        assert set(snapshot["sections"]) == {"job-status", "job-timeline", "job-outputs", "job-error", "job-webhook"}
        assert 'id="cancel-job"' in snapshot["sections"]["job-status"]
        acme.post(f"{job_page}/cancel", data={"csrf_token": token})
        rest = read_events(lines, until="end")
    sections = [data for name, data in rest if name == "sections"]
    assert sections and sections[-1]["status"] == "canceled" and sections[-1]["final"]
    assert 'id="cancel-job"' not in sections[-1]["sections"]["job-status"]
    assert rest[-1][0] == "end"


def test_a_speech_jobs_page_has_the_live_player_and_its_stream_sends_audio_but_not_speech_codes(
        acme: TestClient, redis_client: redis.Redis) -> None:
    assert 'id="live-audio"' not in acme.get(submit(acme).headers["location"], headers=HTML).text  # text-to-text
    job_page = submit(acme, "text-to-speech").headers["location"]
    job_id = job_page.rsplit("/", 1)[1]
    page = acme.get(job_page, headers=HTML).text
    player = re.search(r'<div class="live-audio" id="live-audio"[^>]*>(.*?)</div>', page, re.DOTALL)
    assert player, "no live player on a text-to-speech job's page"
    assert 'data-stage="code2wav"' in player.group(0) and 'data-output="audio"' in player.group(0)
    assert re.search(r'<button type="button" id="live-audio-toggle" aria-pressed="false"[^>]*>Listen live</button>',
                     player.group(1))
    assert 'role="status"' in player.group(1) and "0.0 s of speech received" in player.group(1)
    # The talker's codes are code2wav's input: the page's stream leaves them out; the audio and text go through.
    audio = {"stage": "code2wav", "output": "audio", "attempt": 1, "index": 0, "source_attempt": 1,
             "format": "pcm_s16le", "sample_rate": 24000, "channels": 1, "start": 0, "samples": 2, "data": "AAABAA=="}
    for data in ({"stage": "talker", "output": "audio_codes", "attempt": 1, "index": 0, "codes": "1 2 3"}, audio,
                 {"stage": "thinker", "output": "text", "attempt": 1, "index": 0, "text": "Hi"}):
        event = {"job_id": job_id, "type": "output.delta", "at": time.time(), "data": data}
        redis_client.xadd(job_events_key(job_id), {"event": json.dumps(event)})
    token = csrf_of(acme, job_page)
    with acme.stream("GET", f"{job_page}/stream") as stream:
        lines = stream.iter_lines()
        read_events(lines, until="sections")
        acme.post(f"{job_page}/cancel", data={"csrf_token": token})
        rest = read_events(lines, until="end")
    deltas = [data["data"] for name, data in rest if name == "output.delta"]
    assert [d["output"] for d in deltas] == ["audio", "text"] and deltas[0] == audio


def test_with_auth_off_there_is_no_sign_in(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    settings = Settings(redis_url=redis_url, artifacts_dir=tmp_path / "a", models_dir=tmp_path / "m",
                        auth_enabled=False)
    with TestClient(create_app(settings), follow_redirects=False) as client:
        page = client.get("/ui/jobs", headers=HTML)
        assert page.status_code == 200 and "auth off" in page.text and 'id="sign-out"' not in page.text
        assert client.get("/ui/login", headers=HTML).headers["location"] == "/ui/jobs"


def test_static_files_come_from_the_package_with_cache_busting(anonymous: TestClient) -> None:
    page = anonymous.get("/ui/login", headers=HTML).text
    for name in ("console.css", "console.js", "favicon.svg"):
        url = re.search(rf'/ui/static/{re.escape(name)}\?v=([0-9a-f]{{12}})', page)
        assert url, name
        response = anonymous.get(url.group(0))
        assert response.status_code == 200 and "immutable" in response.headers["cache-control"]
        assert anonymous.get(url.group(0), headers={"if-none-match": response.headers["etag"]}).status_code == 304
    assert anonymous.get("/ui/static/../session.py").status_code == 404
    assert anonymous.get("/ui/static/nope.js").status_code == 404
    assert "<script" not in re.sub(r'<script src="/ui/static/console\.js\?v=[0-9a-f]+" defer></script>', "", page)



def test_the_session_cookie_is_a_server_side_session_that_sign_out_revokes(app: Any, keys: dict[str, str],
                                                                           redis_client: redis.Redis) -> None:
    """The cookie was the API key itself: copied from a browser, it was the key (for every /v1 route, for
    as long as the key lived), and signing out only asked the browser to forget it. Now it names a
    session kept in Redis, which sign-out deletes: the same cookie sent again is signed out."""
    client = signed_in(app, keys["acme"])
    try:
        cookie = client.cookies.get("omni_ui_session")
        assert cookie and keys["acme"] not in cookie and keys["acme"].split("_", 2)[2] not in cookie  # the secret (it may hold "_")
        stored = b"".join(redis_client.dump(k) or b"" for k in redis_client.keys("*"))
        assert cookie.encode() not in stored  # kept hashed, as API keys are
        assert client.get("/v1/jobs", headers={"authorization": f"Bearer {cookie}"}).status_code == 401
        token = csrf_of(client, "/ui/jobs")
        assert client.post("/ui/logout", data={"csrf_token": token}).status_code == 303
    finally:
        client.__exit__(None, None, None)
    with TestClient(app, follow_redirects=False) as replay:
        replay.cookies.set("omni_ui_session", cookie, path="/ui")
        assert replay.get("/ui/jobs", headers=HTML).status_code == 303  # to the sign-in page
        assert replay.get("/ui/jobs/stream").status_code == 401


def test_a_keys_own_quota_applies_to_the_console_as_to_the_api(app: Any, redis_client: redis.Redis) -> None:
    key, info = ApiKeys(redis_client).create("acme", "ui-limited")
    redis_client.hset(f"omni:apikey:{info.id}", "max_active", "1")  # omni-jobs keys limits --key ... --max-active 1
    client = signed_in(app, key)
    try:
        assert submit(client).status_code == 303
        refused = submit(client)
        assert refused.status_code == 429, refused.text
        assert "max_active" in refused.text and refused.headers["retry-after"]
        assert 'class="form-errors"' in refused.text or "field-error" in refused.text or "limit" in refused.text
    finally:
        client.__exit__(None, None, None)


def test_behind_a_tls_proxy_the_session_cookie_is_secure(redis_url: str, redis_client: redis.Redis, tmp_path: Path,
                                                         keys: dict[str, str]) -> None:
    """uvicorn as compose runs it (its api command), reached from another address than loopback, as a
    proxy on another container reaches it, with X-Forwarded-Proto: https: uvicorn trusted only
    127.0.0.1 by default, so the cookie went out without Secure."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import httpx

    from omni_jobs.local.devservices import free_port

    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    command = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", part)  # ${NAME:-default}: compose's default
               for part in compose["services"]["api"]["command"]]
    port = free_port()
    argv = [sys.executable, "-m", *command]
    argv[argv.index("--port") + 1] = str(port)
    env = {**os.environ, "OMNI_REDIS_URL": redis_url, "OMNI_ARTIFACTS_DIR": str(tmp_path / "a"),
           "OMNI_MODELS_DIR": str(tmp_path / "m"), "OMNI_LOG_FORMAT": "text"}
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # which address routes out (nothing sent)
            probe.connect(("192.0.2.1", 9))
            address = probe.getsockname()[0]
    except OSError:
        address = "127.0.0.1"
    if address.startswith("127."):
        pytest.skip("this host has no address but loopback to reach the API from")
    api = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://{address}:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{base}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert api.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        proxied = {"x-forwarded-proto": "https", "x-forwarded-for": "203.0.113.9"}
        with httpx.Client(base_url=base, headers=proxied, follow_redirects=False) as browser:
            page = browser.get("/ui/login", headers=HTML)
            token = CSRF.search(page.text)
            assert token
            # Secure cookies: httpx (plain http to the API) keeps them back; the browser (https to the proxy) not
            csrf = next(c.split(";")[0] for c in page.headers.get_list("set-cookie") if c.startswith("omni_ui_csrf="))
            signed = browser.post("/ui/login", data={"api_key": keys["acme"], "csrf_token": token.group(1)},
                                  headers={"cookie": csrf})
            assert signed.status_code == 303
            session = next(c for c in signed.headers.get_list("set-cookie") if c.startswith("omni_ui_session="))
            assert "Secure" in session, session
    finally:
        api.terminate()
        api.wait(timeout=30)


def test_the_batches_and_usage_pages_show_the_tenants_own(app: Any, acme: TestClient, keys: dict[str, str]) -> None:
    bearer = {"authorization": f"Bearer {keys['acme']}"}
    rows = [{"custom_id": f"c{i}", "url": "/v1/jobs", "body": {"pipeline": "text-to-text", "input": {"prompt": "x"}}}
            for i in range(2)]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    file_id = acme.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"},
                        headers=bearer).json()["id"]
    batch = acme.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/jobs",
                                           "completion_window": "24h"}, headers=bearer).json()
    page = acme.get("/ui/batches", headers=HTML)
    assert page.status_code == 200
    assert f'data-batch="{batch["id"]}" data-status="validating"' in page.text and "0/2" in page.text
    assert submit(acme).status_code == 303  # a job made by the API process: counted as it is queued
    usage = acme.get("/ui/usage", headers=HTML)
    assert usage.status_code == 200 and 'data-tenant="acme"' in usage.text and "queued 1" in usage.text
    other = signed_in(app, keys["other"])  # after acme's API calls: each client runs the app's lifespan
    try:
        assert batch["id"] not in other.get("/ui/batches", headers=HTML).text
        assert 'data-tenant="acme"' not in other.get("/ui/usage", headers=HTML).text
    finally:
        other.__exit__(None, None, None)
