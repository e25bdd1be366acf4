"""Image previews (output.preview) and the text-to-video pipeline, through the HTTP API and real
workers: SSE carries decodable previews (and replays them on resume), a ``preview`` webhook filter
delivers them, cancel still stops a job that previews, and text-to-video returns an MP4 that PyAV
opens with the frames and size asked for."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import httpx
import pytest
from PIL import Image

from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.helpers import submit, wait_for_job
from tests.e2e.test_events_and_wait import read_sse
from tests.e2e.test_webhooks import submit_with_webhook, verify
from tests.webhook_receiver import WebhookReceiver

PREVIEWED = {"ar": {"max_tokens": 4}, "dit": {"height": 32, "width": 48, "num_inference_steps": 6, "seed": 3,
                                               "preview_every": 2}}


def preview_image(data: dict[str, Any]) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(data["data"])))
    image.load()
    assert image.format == "JPEG" and data["media_type"] == "image/jpeg"
    assert image.size == (data["width"], data["height"])
    return image


def previews(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m["event"] == "output.preview"]


@pytest.fixture(scope="module")
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as r:
        yield r


def test_text_to_image_sse_carries_decodable_previews_and_replays_them(api: httpx.Client,
                                                                       system: EmbeddedSystem) -> None:
    job = submit(api, "text-to-image", "a previewed lighthouse", PREVIEWED)
    _, messages, _ = read_sse(system, job["id"])
    assert messages[-1]["event"] == "job.succeeded"
    shown = previews(messages)
    # every 2 of 6 steps, not at the last (the image itself comes next): steps 2 and 4
    assert [(m["data"]["data"]["stage"], m["data"]["data"]["step"], m["data"]["data"]["total"]) for m in shown] == [
        ("dit", 2, 6), ("dit", 4, 6)]
    for m in shown:
        assert preview_image(m["data"]["data"]).size == (48, 32)  # the output's size (<= 256 a side)
    types = [m["event"] for m in messages]
    dit_started = max(i for i, m in enumerate(messages) if m["event"] == "stage.started")
    dit_done = max(i for i, t in enumerate(types) if t == "stage.succeeded")
    assert all(dit_started < messages.index(m) < dit_done for m in shown)  # while the stage ran

    # Last-Event-ID resume replays previews like any other event.
    _, resumed, _ = read_sse(system, job["id"], {"Last-Event-ID": messages[dit_started]["id"]})
    assert [m["id"] for m in resumed] == [m["id"] for m in messages[dit_started + 1:]]
    assert [m["data"] for m in previews(resumed)] == [m["data"] for m in shown]


def test_no_previews_unless_asked(api: httpx.Client, system: EmbeddedSystem) -> None:
    params = {"ar": {"max_tokens": 4}, "dit": {"height": 32, "width": 32, "num_inference_steps": 4}}
    job = wait_for_job(api, submit(api, "text-to-image", "no previews", params)["id"])
    assert job["params"]["dit"]["preview_every"] == 0  # the default, recorded on the job
    _, messages, _ = read_sse(system, job["id"])
    assert messages and previews(messages) == []


def test_bad_preview_every_is_422_naming_the_field(api: httpx.Client) -> None:
    body = {"pipeline": "text-to-image", "input": {"prompt": "x"}, "params": {"dit": {"preview_every": -1}}}
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    assert any(d["loc"][-2:] == ["dit", "preview_every"] for d in response.json()["detail"]), response.text


def test_preview_webhook_filter_delivers_previews(api: httpx.Client, receiver: WebhookReceiver) -> None:
    url = receiver.script("/previews", [])
    accepted = submit_with_webhook(api, url, ["preview", "completed"], pipeline="text-to-image", params=PREVIEWED)
    assert accepted["webhook"]["events"] == ["completed", "preview"]
    job = wait_for_job(api, accepted["id"])
    assert job["status"] == "succeeded"
    receiver.wait_until(lambda: any(r.headers["omni-webhook-event"] == "completed"
                                    for r in receiver.at("/previews")), what="the completed webhook")
    got = receiver.at("/previews")
    events = [r.headers["omni-webhook-event"] for r in got]
    assert set(events) == {"preview", "completed"} and events.count("preview") >= 1
    for r in got:
        body = verify(r)
        assert body["id"] == job["id"]
        if r.headers["omni-webhook-event"] == "preview":
            preview = body["preview"]
            assert preview["stage"] == "dit" and preview["step"] in (2, 4) and preview["total"] == 6
            assert preview_image(preview).size == (48, 32)
        else:
            assert "preview" not in body


def test_cancel_stops_a_previewing_job_within_a_step(api: httpx.Client, system: EmbeddedSystem) -> None:
    slow = {"ar": {"max_tokens": 2}, "dit": {"height": 256, "width": 256, "num_inference_steps": 200,
                                             "preview_every": 1}}
    job = submit(api, "text-to-image", "cancel me while previewing", slow)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        current = api.get(f"/v1/jobs/{job['id']}").json()
        if current["stage"] == "dit" and current["progress"] and current["progress"]["step"] >= 2:
            break
        time.sleep(0.05)
    assert api.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
    final = wait_for_job(api, job["id"])
    assert final["status"] == "canceled" and final["outputs"] == []
    time.sleep(1.0)  # the worker stops at its next step: no preview or progress is written after that
    _, messages, _ = read_sse(system, job["id"])
    canceled_at = next(i for i, m in enumerate(messages) if m["event"] == "job.canceled")
    assert messages[-1]["event"] == "job.canceled" and canceled_at == len(messages) - 1
    assert len(previews(messages)) >= 1  # it did preview before the cancel
    assert api.get(f"/v1/jobs/{job['id']}").json()["progress"] is None


def test_text_to_video_returns_an_mp4_with_its_metadata_and_previews(api: httpx.Client,
                                                                      system: EmbeddedSystem) -> None:
    params = {"video": {"height": 32, "width": 48, "num_frames": 9, "fps": 8, "num_inference_steps": 4,
                        "seed": 1, "preview_every": 2}}
    job = submit(api, "text-to-video", "a cat walking on a wall", params)
    _, messages, _ = read_sse(system, job["id"])
    final = wait_for_job(api, job["id"])
    assert final["status"] == "succeeded", final["error"]
    (out,) = final["outputs"]
    assert (out["name"], out["type"], out["media_type"]) == ("video", "video", "video/mp4")
    assert (out["frames"], out["fps"], out["width"], out["height"]) == (9, 8.0, 48, 32)
    assert out["duration_s"] == pytest.approx(9 / 8)

    data = httpx.get(out["url"], timeout=30).raise_for_status().content
    assert len(data) == out["size"]
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert len(frames) == 9 and frames[0].shape == (32, 48, 3)

    (shown,) = previews(messages)  # step 2 of 4: one frame of the video's latents
    assert (shown["data"]["data"]["stage"], shown["data"]["data"]["step"]) == ("video", 2)
    assert preview_image(shown["data"]["data"]).size == (48, 32)


def test_bad_video_params_are_422(api: httpx.Client) -> None:
    body = {"pipeline": "text-to-video", "input": {"prompt": "x"}, "params": {"video": {"height": 40}}}
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 422 and "multiple of 16" in response.text


def test_video_is_a_modality_in_models_and_pipelines(api: httpx.Client) -> None:
    model = api.get("/v1/models/text-to-video").json()
    assert model["output_modalities"] == ["video"]
    assert "text-to-video" in {m["id"] for m in api.get("/v1/models").json()["data"]}
    pipeline = api.get("/v1/pipelines/text-to-video").json()
    assert "video" in str(pipeline)


def test_a_frame_count_the_model_cannot_make_fails_the_stage_saying_why(api: httpx.Client) -> None:
    params = {"video": {"num_frames": 10, "num_inference_steps": 1}}
    job = wait_for_job(api, submit(api, "text-to-video", "ten frames", params)["id"])
    assert job["status"] == "failed" and job["error"]["stage"] == "video"
    assert "num_frames 10 must be 4k+1" in job["error"]["message"]


def test_cli_submit_wait_saves_the_mp4_and_the_previews(system: EmbeddedSystem, tmp_path: Path) -> None:
    from tests.e2e.test_cli import omni

    run = omni(system, "submit", "text-to-video", "--prompt", "a paper boat drifting",
               "--param", "video.num_inference_steps=4", "--param", "video.preview_every=1", "--wait",
               "--save-previews", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    paths = dict(line.split("\t") for line in run.stdout.strip().splitlines())
    video = Path(paths["video"])
    assert video.name == "video.mp4"
    with av.open(str(video)) as container:
        assert sum(1 for _ in container.decode(video=0)) == 9
    saved = sorted(p.name for p in (video.parent / "previews").iterdir())
    # Steps 1-3 of 4 each hand over a preview; the progress writer publishes the newest one of a stage
    # when it falls behind (an earlier one may be replaced), and always the last before the result.
    assert saved[-1] == "video-step0003.jpg", saved
    assert set(saved) <= {"video-step0001.jpg", "video-step0002.jpg", "video-step0003.jpg"}, saved
    with Image.open(video.parent / "previews" / saved[0]) as image:
        assert (image.format, image.size) == ("JPEG", (32, 32))
