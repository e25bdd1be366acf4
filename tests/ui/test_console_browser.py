"""The web console in Debian's chromium, through the real API and real Celery workers.

Each test drives pages as a person would (fill, click, watch) and checks what the browser itself
sees: the status changing without a reload, the PNG decoded (naturalWidth), the WAV playing
(duration, currentTime), errors beside their fields, another tenant's pages answering 404.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from PIL import Image

from omni_jobs.core import keys
from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.conftest import auth_headers
from tests.e2e.helpers import wait_for_job
from tests.ui.conftest import screenshot
from tests.webhook_receiver import WebhookReceiver

pytestmark = [pytest.mark.ui, pytest.mark.e2e, pytest.mark.slow]

JOB_TIMEOUT_MS = 180_000
FAST_IMAGE = {"params.ar.max_tokens": "8", "params.dit.height": "32", "params.dit.width": "32",
              "params.dit.num_inference_steps": "2"}


def api_client(system: EmbeddedSystem, key: str) -> httpx.Client:
    return httpx.Client(base_url=system.api_url, timeout=30, headers=auth_headers(key))


def fill_playground(page: Any, pipeline: str, prompt: str, values: dict[str, str] | None = None) -> None:
    page.goto(f"/ui/pipelines/{pipeline}")
    page.fill("[name='input.prompt']", prompt)
    for name, value in (values or {}).items():
        page.fill(f"[name='{name}']", value)


def submit_and_open(page: Any) -> str:
    # Leaving the last filled field re-renders its hint (the page moves): leave it first, as a person
    # does before reaching for the button, so that the click lands where the button then is.
    page.evaluate("document.activeElement && document.activeElement.blur()")
    page.click("#submit-job")
    page.wait_for_url(re.compile(r".*/ui/jobs/job_[0-9a-f]+$"))
    return str(page.url.rsplit("/", 1)[-1])


def mark_page(page: Any) -> None:
    """A flag that only survives while this document lives: a reload would drop it."""
    page.evaluate("window.__notReloaded = true")


def wait_status(page: Any, status: str, timeout_ms: int = JOB_TIMEOUT_MS) -> None:
    page.wait_for_function(
        "s => document.querySelector('#job-status-badge')?.dataset.status === s", arg=status, timeout=timeout_ms)


def test_sign_in_with_an_api_key(new_page: Callable[..., Any], tenant_keys: dict[str, str],
                                 ui_system: EmbeddedSystem) -> None:
    page = new_page()
    page.goto("/ui/jobs")
    assert "/ui/login" in page.url, "an anonymous visit must land on the sign-in page"
    screenshot(page, "login")

    page.fill("input[name=api_key]", "ok_0123456789abcdef_" + "A" * 43)
    page.click("button[type=submit]")
    assert page.locator(".field-error").inner_text().startswith("That API key was not accepted")
    assert "/ui/login" in page.url

    page.fill("input[name=api_key]", tenant_keys["alpha"])
    page.click("button[type=submit]")
    page.wait_for_url("**/ui/jobs")
    assert page.locator("#tenant").inner_text() == "alpha"
    assert tenant_keys["alpha"] not in page.url and tenant_keys["alpha"] not in page.content()
    cookies = {c["name"]: c for c in page.context.cookies()}
    session = cookies["omni_ui_session"]
    assert session["httpOnly"] and session["sameSite"] == "Strict" and session["path"] == "/ui"
    assert "omni_ui_session" not in page.evaluate("document.cookie"), "the key must be out of scripts' reach"
    # The header links to the API docs and to Flower (its URL from OMNI_UI_FLOWER_URL).
    assert page.get_attribute("#flower-link", "href") == ui_system.flower_url
    assert page.get_attribute("a[href='/docs']", "href") == "/docs"
    screenshot(page, "jobs-empty")

    page.click("#sign-out")
    page.wait_for_url("**/ui/login**")
    assert "omni_ui_session" not in {c["name"] for c in page.context.cookies()}
    page.goto("/ui/jobs")
    assert "/ui/login" in page.url, "signed out: the pages ask to sign in again"


def test_text_to_image_from_the_playground_goes_live_to_succeeded(
        sign_in: Callable[[str], Any], ui_system: EmbeddedSystem, tenant_keys: dict[str, str]) -> None:
    page = sign_in("alpha")
    fill_playground(page, "text-to-image", "a lighthouse at dusk", FAST_IMAGE)
    screenshot(page, "playground-text-to-image")
    job_id = submit_and_open(page)
    mark_page(page)
    assert page.locator("#job-status-badge").get_attribute("data-status") in ("queued", "running", "succeeded")

    wait_status(page, "succeeded")
    assert page.evaluate("window.__notReloaded === true"), "the page reached succeeded by itself, not by a reload"
    image = page.locator("figure[data-output=image] img")
    image.wait_for()
    page.wait_for_function("() => document.querySelector('figure[data-output=image] img').complete")
    size = image.evaluate("img => [img.naturalWidth, img.naturalHeight]")
    assert size == [32, 32], f"the PNG was not decoded at its size: {size}"
    # Text output inline (as the API has it), each output with a download link that serves the file.
    with api_client(ui_system, tenant_keys["alpha"]) as api:
        text = next(o["text"] for o in api.get(f"/v1/jobs/{job_id}").json()["outputs"] if o["name"] == "text")
    if text.strip():
        assert page.locator("figure[data-output=text] pre").text_content() == text
    else:  # the tiny random model may well say nothing; the page says so rather than show an empty box
        assert page.locator("figure[data-output=text] .empty-text").count() == 1
    download = page.request.get(page.get_attribute("figure[data-output=image] a.download", "href"))
    assert download.status == 200 and download.headers["content-type"] == "image/png"
    assert download.body()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "attachment" in download.headers["content-disposition"]
    # The stage timeline: both stages done, with times, attempts and the worker that ran them.
    for stage in ("ar", "dit"):
        row = page.locator(f"#stage-table tr[data-stage={stage}]")
        assert row.locator(".badge").inner_text() == "succeeded"
        assert int(row.locator("[data-col=attempts]").inner_text()) >= 1
        assert "@" in row.locator("[data-col=worker]").inner_text()
        assert row.locator("[data-col=wait]").inner_text() not in ("", "–")
    assert page.locator("#cancel-job").count() == 0, "no cancel button once the job ended"
    screenshot(page, "job-text-to-image")

    # The list shows it, newest first, with its status.
    page.goto("/ui/jobs")
    first = page.locator("#job-rows tr").first
    assert first.get_attribute("data-job-id") == job_id
    assert first.locator("[data-status]").inner_text() == "succeeded"


def test_text_to_audio_plays_its_wav(sign_in: Callable[[str], Any]) -> None:
    page = sign_in("alpha")
    fill_playground(page, "text-to-audio", "rain on a tin roof", {"params.ar.max_tokens": "4"})
    submit_and_open(page)
    wait_status(page, "succeeded")
    audio = page.locator("figure[data-output=audio] audio")
    audio.wait_for()
    assert audio.get_attribute("controls") is not None
    page.wait_for_function("() => document.querySelector('figure[data-output=audio] audio').readyState >= 1")
    duration = audio.evaluate("a => a.duration")
    assert duration > 0, f"the WAV has no duration in the browser: {duration}"
    played = audio.evaluate("""a => new Promise((resolve, reject) => {
        a.muted = true;
        a.addEventListener('ended', () => resolve(a.currentTime), {once: true});
        a.addEventListener('error', () => reject(new Error('media error ' + (a.error && a.error.code))));
        a.play().catch(reject);
        setTimeout(() => resolve(a.currentTime), 5000);
    })""")
    assert played > 0, "the audio element did not play"
    screenshot(page, "job-text-to-audio")


def test_cancel_a_running_job_from_its_page_and_see_streamed_parts(
        sign_in: Callable[[str], Any], ui_system: EmbeddedSystem, tenant_keys: dict[str, str]) -> None:
    page = sign_in("alpha")
    # Many denoising steps on a larger image: long enough to be seen running and then cancelled.
    fill_playground(page, "text-to-image", "a slow, detailed cathedral", {
        "params.ar.max_tokens": "4", "params.dit.height": "512", "params.dit.width": "512",
        "params.dit.num_inference_steps": "200"})
    job_id = submit_and_open(page)
    mark_page(page)
    page.wait_for_function(
        "() => document.querySelector('#job-progress label')?.textContent.startsWith('dit:')", timeout=JOB_TIMEOUT_MS)
    assert page.locator("#job-status-badge").get_attribute("data-status") == "running"
    assert page.locator("#job-progress-bar").get_attribute("max") == "200"

    # Streamed partial outputs appear as they come. Written straight to the job's event stream, in the
    # workers' shape, so the text is known (a real worker's text is random here) and a second attempt
    # (a stage run again after its worker was lost) can be shown to restart the text, not repeat it.
    def emit(*events: tuple[str, dict[str, Any]]) -> None:
        client = redis.Redis.from_url(ui_system.redis_url or "")
        try:
            for event_type, data in events:
                event = {"job_id": job_id, "type": event_type, "at": time.time(), "data": data}
                client.xadd(keys.job_events(job_id), {"event": json.dumps(event)})
        finally:
            client.close()

    live_text = "() => document.querySelector('#job-live pre[data-live=\"ar.text\"]')?.textContent"
    emit(("output.delta", {"stage": "ar", "output": "text", "text": "A tall ", "index": 0, "attempt": 1}),
         ("output.delta", {"stage": "ar", "output": "text", "text": "cathedral", "index": 1, "attempt": 1}),
         ("output.preview", {"stage": "dit", "output": "image", "step": 3, "total": 200,
                             "media_type": "image/png", "data": TINY_PNG_B64}))
    page.wait_for_function("() => !document.querySelector('#job-live').hidden")
    page.wait_for_function(f"() => ({live_text})() === 'A tall cathedral'")
    emit(("output.delta", {"stage": "ar", "output": "text", "text": "A tall ", "index": 0, "attempt": 2}))
    page.wait_for_function(f"() => ({live_text})() === 'A tall '")
    page.wait_for_function("() => document.querySelector('#job-live img[data-live=image]')?.naturalWidth === 2")
    screenshot(page, "job-running")

    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#cancel-job")
    wait_status(page, "canceled", timeout_ms=30_000)
    assert page.locator(".notice").inner_text() == "The job was canceled."
    assert page.locator("#cancel-job").count() == 0
    assert page.locator("#stage-table tr[data-stage=dit] .badge").inner_text() == "canceled"
    screenshot(page, "job-canceled")
    with api_client(ui_system, tenant_keys["alpha"]) as api:
        assert wait_for_job(api, job_id, timeout_s=30)["status"] == "canceled"


TINY_PNG_B64 = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGM8ISfHwMDAxMDA4PNtHwAQkgMISeU3OQAAAABJRU5ErkJggg=="
"""A 2x2 PNG, as a DiT preview would carry it (base64)."""


def test_a_bad_parameter_shows_its_error_beside_the_field(sign_in: Callable[[str], Any],
                                                            tenant_keys: dict[str, str],
                                                            ui_system: EmbeddedSystem) -> None:
    page = sign_in("alpha")
    with api_client(ui_system, tenant_keys["alpha"]) as api:
        before = len(api.get("/v1/jobs", params={"limit": 100}).json()["data"])
        fill_playground(page, "text-to-image", "a fox", {
            "params.dit.height": "100", "params.ar.prompt_template": "no placeholder here", "params.dit.seed": "7"})
        page.click("#submit-job")
        height = page.locator("[data-field='params.dit.height']")
        height.locator(".field-error").wait_for()
        assert "multiple of 8" in height.locator(".field-error").inner_text()
        assert height.locator("input").get_attribute("aria-invalid") == "true"
        assert "{prompt}" in page.locator("[data-field='params.ar.prompt_template'] .field-error").inner_text()
        assert page.locator(".field-error").count() == 2, "only the two bad fields are marked"
        # What was typed is kept, and nothing was submitted.
        assert page.input_value("[name='params.dit.height']") == "100"
        assert page.input_value("[name='params.dit.seed']") == "7"
        assert page.input_value("[name='input.prompt']") == "a fox"
        assert "/ui/pipelines/text-to-image" in page.url
        screenshot(page, "playground-errors")
        assert len(api.get("/v1/jobs", params={"limit": 100}).json()["data"]) == before


def test_a_failed_job_shows_its_error_and_stage(sign_in: Callable[[str], Any]) -> None:
    page = sign_in("alpha")
    fill_playground(page, "broken-model", "anything")
    submit_and_open(page)
    wait_status(page, "failed")
    assert page.locator("#error-stage").inner_text() == "ar"
    assert "/nonexistent/omni-model" in page.locator("#error-message").inner_text()
    assert page.locator("#stage-table tr[data-stage=ar] .badge").inner_text() == "failed"
    screenshot(page, "job-failed")


def test_the_jobs_list_updates_live_and_filters(sign_in: Callable[[str], Any], tenant_keys: dict[str, str],
                                                ui_system: EmbeddedSystem) -> None:
    page = sign_in("alpha")
    mark_page(page)
    with api_client(ui_system, tenant_keys["alpha"]) as api:
        job = api.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": "live list"},
                                         "params": {"ar": {"max_tokens": 4}}}).json()
    row = page.locator(f"#job-rows tr[data-job-id='{job['id']}']")
    row.wait_for(timeout=15_000)
    page.wait_for_function(
        "id => document.querySelector(`#job-rows tr[data-job-id='${id}'] [data-status]`)?.textContent === 'succeeded'",
        arg=job["id"], timeout=JOB_TIMEOUT_MS)
    assert page.evaluate("window.__notReloaded === true"), "the list changed by itself, not by a reload"
    assert page.locator("#job-rows tr").first.get_attribute("data-job-id") == job["id"], "newest first"
    screenshot(page, "jobs")

    page.select_option("select[name=pipeline]", "text-to-text")
    page.wait_for_url("**pipeline=text-to-text**")
    pipelines = set(page.locator("#job-rows tr[data-job-id] td:nth-child(2)").all_inner_texts())
    assert pipelines == {"text-to-text"}
    page.select_option("select[name=status]", "failed")
    page.wait_for_url("**status=failed**")
    assert page.locator("#job-rows tr[data-job-id]").count() == 0  # no failed text-to-text job
    page.goto("/ui/jobs?status=succeeded&limit=10")
    statuses = set(page.locator("#job-rows [data-status]").all_inner_texts())
    assert statuses == {"succeeded"}


def test_paging_walks_every_job_once(sign_in: Callable[[str], Any], tenant_keys: dict[str, str],
                                     ui_system: EmbeddedSystem) -> None:
    with api_client(ui_system, tenant_keys["alpha"]) as api:
        have = len(api.get("/v1/jobs", params={"limit": 100}).json()["data"])
        for index in range(max(0, 13 - have)):  # enough for two pages of 10 (they need not finish)
            api.post("/v1/jobs", json={"pipeline": "text-to-text", "input": {"prompt": f"page {index}"},
                                       "params": {"ar": {"max_tokens": 2}}}).raise_for_status()
        every = api.get("/v1/jobs", params={"limit": 100}).json()["data"]
    page = sign_in("alpha")
    for query, expected in (("limit=10", [j["id"] for j in every]),
                            ("limit=10&pipeline=text-to-text",
                             [j["id"] for j in every if j["pipeline"] == "text-to-text"])):
        seen: list[str] = []
        pages = 0
        page.goto(f"/ui/jobs?{query}")
        while True:
            pages += 1
            seen.extend(page.locator("#job-rows tr[data-job-id]").evaluate_all("rows => rows.map(r => r.dataset.jobId)"))
            if page.locator("#next-page").count() == 0:
                break
            page.click("#next-page")
            page.wait_for_load_state()
        assert seen == expected, query
        assert pages <= len(expected) // 10 + 1, (query, pages)


def test_image_upload_in_the_playground(sign_in: Callable[[str], Any], tmp_path: Path) -> None:
    photo = tmp_path / "photo.png"
    Image.new("RGB", (48, 40), (30, 120, 200)).save(photo)
    page = sign_in("alpha")
    page.goto("/ui/pipelines/image-to-image")
    page.fill("[name='input.prompt']", "make it red")
    page.fill("[name='params.dit.num_inference_steps']", "2")
    page.fill("[name='params.dit.strength']", "0.5")
    page.set_input_files("[name='input.image']", str(photo))
    page.wait_for_function("() => document.querySelector('#f-input-image-preview').naturalWidth === 48")
    job_id = submit_and_open(page)
    wait_status(page, "succeeded")
    size = page.locator("figure[data-output=image] img").evaluate(
        "img => img.complete ? [img.naturalWidth, img.naturalHeight] : null")
    assert size == [48, 40], size  # image-to-image keeps the input's size (rounded to 8)
    assert "48" in page.locator("#job-request").inner_text()
    assert job_id in page.url


def test_another_tenant_sees_none_of_these_jobs(sign_in: Callable[[str], Any], tenant_keys: dict[str, str],
                                                ui_system: EmbeddedSystem) -> None:
    with api_client(ui_system, tenant_keys["alpha"]) as api:
        alpha_jobs = [j for j in api.get("/v1/jobs", params={"limit": 100}).json()["data"]]
    assert alpha_jobs, "earlier tests made jobs for tenant alpha"
    job = next(j for j in alpha_jobs if j["status"] == "succeeded" and j["outputs"])
    page = sign_in("beta")
    assert page.locator("#tenant").inner_text() == "beta"
    listed = set(page.locator("#job-rows tr[data-job-id]").evaluate_all("rows => rows.map(r => r.dataset.jobId)"))
    assert not listed & {j["id"] for j in alpha_jobs}
    for status in ("succeeded", "failed", "canceled"):
        page.goto(f"/ui/jobs?status={status}")
        assert page.locator("#job-rows tr[data-job-id]").count() == 0

    response = page.goto(f"/ui/jobs/{job['id']}")
    assert response is not None and response.status == 404
    assert page.locator("h1").inner_text() == "Not found"
    screenshot(page, "other-tenant-404")
    for path in (f"/ui/jobs/{job['id']}/outputs/{job['outputs'][0]['name']}", f"/ui/jobs/{job['id']}/stream",
                 f"/ui/pipelines/{job['pipeline']}?from={job['id']}"):
        answer = page.request.get(path)
        if "?from=" in path:  # the playground opens, but without the other tenant's values
            assert answer.status == 200 and job["input"]["prompt"] not in answer.text()
        else:
            assert answer.status == 404, (path, answer.status)
    # Cancelling another tenant's job from a page of one's own: 404, and the job is untouched.
    page.goto("/ui/jobs")
    token = page.locator("input[name=csrf_token]").first.input_value()
    answer = page.request.post(f"/ui/jobs/{job['id']}/cancel", form={"csrf_token": token})
    assert answer.status == 404


def test_webhook_deliveries_are_listed_on_the_job_page(sign_in: Callable[[str], Any], tenant_keys: dict[str, str],
                                                       ui_system: EmbeddedSystem) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page = sign_in("alpha")
    with WebhookReceiver() as receiver:
        url = receiver.url("/ui-hook")
        fill_playground(page, "text-to-text", "call me back", {"params.ar.max_tokens": "4"})
        page.click("details.options summary")
        page.fill("[name=webhook]", url)
        job_id = submit_and_open(page)
        mark_page(page)
        wait_status(page, "succeeded")
        receiver.wait_until(lambda: any(r.headers.get("omni-webhook-event") == "completed"
                                        for r in receiver.at("/ui-hook")), what="the completed webhook")
        # Deliveries are recorded after the job ends; the page keeps following them a while.
        try:
            # both deliveries: each is recorded when it is answered, so 'start' may show after 'completed'
            page.wait_for_function("""() => ['start', 'completed'].every(event =>
                [...document.querySelectorAll('#webhook-deliveries tbody tr')]
                    .some(tr => tr.cells[1].textContent === event && tr.cells[4].textContent === '200'))""",
                                   timeout=30_000)
        except PlaywrightTimeout as exc:  # say what the page and the API saw: this timed out in CI, uncaught
            with api_client(ui_system, tenant_keys["alpha"]) as api:
                webhook = api.get(f"/v1/jobs/{job_id}").json().get("webhook")
            pytest.fail(f"{exc}\npage stream: {page.get_attribute('[data-job-stream]', 'data-live')}\n"
                        f"page webhook section: {page.locator('#job-webhook').inner_html()}\n"
                        f"API's webhook: {json.dumps(webhook)}\nreceived: "
                        f"{[(r.headers.get('omni-webhook-event'), r.answered, r.at) for r in receiver.at('/ui-hook')]}")
    assert page.evaluate("window.__notReloaded === true")
    events = {row.split("\t")[1] for row in page.locator("#webhook-deliveries tbody tr").all_inner_texts()}
    assert {"start", "completed"} <= events, events
    assert url in page.locator("#job-webhook").inner_text()
    assert job_id in page.url
    screenshot(page, "job-webhook")


def test_the_pipelines_page_draws_each_stage_graph(sign_in: Callable[[str], Any], tenant_keys: dict[str, str],
                                                   ui_system: EmbeddedSystem) -> None:
    with api_client(ui_system, tenant_keys["alpha"]) as api:
        specs = api.get("/v1/pipelines").json()
    page = sign_in("alpha")
    page.goto("/ui/pipelines")
    for spec in specs:
        graph = page.locator(f"svg[data-pipeline-graph='{spec['name']}']")
        drawn = set(graph.locator("[data-node]").evaluate_all("nodes => nodes.map(n => n.dataset.node)"))
        wanted = ({f"input:{name}" for name in spec["inputs"]} | {f"stage:{s['id']}" for s in spec["stages"]}
                  | {f"output:{o['name']}" for o in spec["outputs"]})
        assert drawn == wanted, spec["name"]
        edges = set(graph.locator("[data-edge]").evaluate_all("edges => edges.map(e => e.dataset.edge)"))
        for stage in spec["stages"]:
            for binding in stage["inputs"].values():
                source, port = binding.split(".", 1)
                origin = f"input:{port}" if source == "input" else f"stage:{source}"
                assert f"{origin}->stage:{stage['id']}" in edges, (spec["name"], binding)
        for stage in spec["stages"]:
            assert stage["model"] in page.locator(f"#pipeline-{spec['name']}").inner_text()
    screenshot(page, "pipelines")
    page.click("#pipeline-text-to-image a.button")
    page.wait_for_url("**/ui/pipelines/text-to-image")
    # The form comes from the spec: the stage defaults and the parameter bounds.
    height = page.locator("[name='params.dit.height']")
    assert height.input_value() == "64" and height.get_attribute("step") == "8"
    assert height.get_attribute("min") == "16" and height.get_attribute("max") == "2048"
    assert page.input_value("[name='params.ar.max_tokens']") == "24"
    page.goto("/ui/pipelines/image-to-image")
    assert page.get_attribute("[name='input.image']", "type") == "file"
    assert page.input_value("[name='params.dit.strength']") == "0.6"
