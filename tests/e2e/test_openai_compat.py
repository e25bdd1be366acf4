"""The OpenAI-compatible endpoints driven by the official ``openai`` client, against the real system.

Every call is a job (its id comes back in X-Omni-Job-Id and the job is in /v1/jobs); outputs are
checked as real PNG/WAV bytes, and against the same job submitted through /v1/jobs.
"""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from PIL import Image

from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.helpers import submit, wait_for_job


@pytest.fixture
def client(system: EmbeddedSystem) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{system.api_url}/v1", api_key=system.api_key, timeout=180) as c:
        yield c


def png(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    assert image.format == "PNG"
    return image


def data_url_png(url: str) -> Image.Image:
    prefix = "data:image/png;base64,"
    assert url.startswith(prefix), url[:40]
    return png(base64.b64decode(url[len(prefix):]))


def job_of(api: httpx.Client, job_id: str) -> dict[str, Any]:
    return api.get(f"/v1/jobs/{job_id}").raise_for_status().json()


def test_models_are_the_pipelines(client: OpenAI, api: httpx.Client) -> None:
    ids = {m.id for m in client.models.list()}
    assert ids == {p["name"] for p in api.get("/v1/pipelines").json()}
    assert {"text-to-text", "text-to-image", "broken-model"} <= ids
    t2i = client.models.retrieve("text-to-image")
    assert t2i.owned_by == "omni-jobs" and t2i.model_extra is not None
    assert set(t2i.model_extra["output_modalities"]) == {"image", "text"}
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found"


def test_chat_completion_runs_a_text_job(client: OpenAI, api: httpx.Client) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="text-to-text", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=6)
    job_id = raw.headers["x-omni-job-id"]
    completion = raw.parse()
    assert completion.id == f"chatcmpl-{job_id}" and completion.model == "text-to-text"
    (choice,) = completion.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"  # random tiny weights: no EOS within 6 greedy tokens

    job = job_of(api, job_id)  # an ordinary job, visible in the jobs API
    assert (job["status"], job["pipeline"], job["input"]) == ("succeeded", "text-to-text",
                                                            {"prompt": "Once upon a time"})
    assert job["params"]["ar"]["max_tokens"] == 6
    assert [o["text"] for o in job["outputs"]] == [choice.message.content]
    # The same request through /v1/jobs gives the same (greedy) text.
    direct = wait_for_job(api, submit(api, "text-to-text", "Once upon a time", {"ar": {"max_tokens": 6}})["id"])
    assert direct["outputs"][0]["text"] == choice.message.content
    # A longer budget ends the same way but later: what max_tokens limits is real.
    longer = client.chat.completions.create(model="text-to-text", max_completion_tokens=12,
                                            messages=[{"role": "user", "content": "Once upon a time"}])
    assert longer.choices[0].message.content.startswith(choice.message.content)  # type: ignore[union-attr]
    assert len(longer.choices[0].message.content or "") > len(choice.message.content)


def test_any_model_name_routes_by_the_modalities_asked(client: OpenAI) -> None:
    completion = client.chat.completions.create(model="gpt-4o-mini", max_tokens=3,
                                                messages=[{"role": "system", "content": "Be brief."},
                                                          {"role": "user", "content": "Hello"}])
    assert completion.model == "text-to-text" and completion.choices[0].message.content


def test_chat_with_image_modality_returns_the_png_inline(client: OpenAI, api: httpx.Client) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=[{"role": "user", "content": "a red fox in the snow"}],
        modalities=["text", "image"],  # type: ignore[list-item]
        max_tokens=8, extra_body={"size": "48x32", "num_inference_steps": 3, "seed": 5})
    job = job_of(api, raw.headers["x-omni-job-id"])
    completion = raw.parse()
    assert completion.model == "text-to-image" and job["pipeline"] == "text-to-image"
    assert (job["params"]["dit"]["width"], job["params"]["dit"]["height"], job["params"]["dit"]["seed"],
            job["params"]["dit"]["num_inference_steps"], job["params"]["ar"]["max_tokens"]) == (48, 32, 5, 3, 8)
    text_choice, image_choice = completion.choices
    assert text_choice.message.content == {o["name"]: o for o in job["outputs"]}["text"]["text"]
    (part,) = image_choice.message.content  # type: ignore[misc]  # a list of parts, as vLLM-Omni answers
    image = data_url_png(part["image_url"]["url"])  # type: ignore[index]
    assert image.size == (48, 32)
    stored = api.get(f"/v1/jobs/{job['id']}/outputs/image").content
    assert base64.b64decode(part["image_url"]["url"].split(",", 1)[1]) == stored  # type: ignore[index]


def test_images_generations_dall_e_shape(client: OpenAI, api: httpx.Client) -> None:
    raw = client.images.with_raw_response.generate(
        model="dall-e-3", prompt="a lighthouse at dusk", n=2, size="32x32", response_format="b64_json",
        extra_body={"seed": 7, "num_inference_steps": 2})
    job_ids = raw.headers["x-omni-job-id"].split(",")
    result = raw.parse()
    assert len(job_ids) == 2 and result.data is not None and len(result.data) == 2
    images = [base64.b64decode(d.b64_json or "") for d in result.data]
    assert [png(b).size for b in images] == [(32, 32), (32, 32)]
    assert images[0] != images[1]  # n images, not n copies
    jobs = [job_of(api, i) for i in job_ids]
    assert [j["params"]["dit"]["seed"] for j in jobs] == [7, 8]
    assert all(j["pipeline"] == "text-to-image" and j["status"] == "succeeded" for j in jobs)
    assert result.data[0].revised_prompt == {o["name"]: o for o in jobs[0]["outputs"]}["text"]["text"]

    # response_format=url: a download URL for the stored output; same seed, same bytes.
    by_url = client.images.generate(model="text-to-image", prompt="a lighthouse at dusk", size="32x32",
                                    response_format="url", extra_body={"seed": 7, "num_inference_steps": 2})
    assert by_url.data is not None and by_url.data[0].url
    assert httpx.get(by_url.data[0].url, timeout=30).raise_for_status().content == images[0]


def test_speech_from_the_text_to_audio_pipeline(client: OpenAI, api: httpx.Client) -> None:
    raw = client.audio.speech.with_raw_response.create(model="tts-1", voice="alloy", input="a short beep",
                                                       response_format="wav")
    job = job_of(api, raw.headers["x-omni-job-id"])
    assert job["pipeline"] == "text-to-audio" and job["status"] == "succeeded"
    assert raw.headers["content-type"] == "audio/wav"
    data = raw.parse().content
    (out,) = [o for o in job["outputs"] if o["type"] == "audio"]
    with wave.open(io.BytesIO(data)) as w:
        assert w.getframerate() == out["sample_rate"]
        assert w.getnframes() / w.getframerate() == pytest.approx(out["duration_s"], abs=0.01)
    assert api.get(f"/v1/jobs/{job['id']}/outputs/{out['name']}").content == data

    chat = client.chat.completions.create(model="gpt-4o-audio-preview", modalities=["text", "audio"],
                                          audio={"voice": "alloy", "format": "wav"},
                                          messages=[{"role": "user", "content": "a short beep"}])
    assert chat.model == "text-to-audio"
    audio = chat.choices[1].message.audio
    assert audio is not None and audio.transcript == chat.choices[0].message.content
    assert base64.b64decode(audio.data)[:4] == b"RIFF"


@pytest.mark.parametrize(
    ("call", "param", "fragment"),
    [
        (lambda c: c.images.generate(prompt="x", size="big"), "size", "WIDTHxHEIGHT"),
        (lambda c: c.images.generate(prompt="x", size="50x50"), "size", "multiple of 8"),
        (lambda c: c.images.generate(prompt="x", model="text-to-text"), "model", "outputs ['text'], not ['image']"),
        (lambda c: c.chat.completions.create(model="text-to-image", modalities=["audio"],
                                             messages=[{"role": "user", "content": "x"}]),
         "modalities", "not ['audio']"),
        (lambda c: c.chat.completions.create(model="text-to-text", max_tokens=0,
                                             messages=[{"role": "user", "content": "x"}]),
         "max_tokens", "greater than or equal to 1"),
        (lambda c: c.chat.completions.create(model="text-to-text", messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
         "messages[0].content[0]", "takes no image input; models that take it: image-to-text"),
        (lambda c: c.chat.completions.create(model="text-to-text", messages=[]), "messages", "at least 1"),
        (lambda c: c.audio.speech.create(model="text-to-speech", voice="alloy", input="x"),
         "voice", "Chelsie"),
    ],
    ids=["size-format", "size-multiple", "model-without-image", "modality-missing", "max-tokens", "image-input",
         "no-messages", "unknown-voice"],
)
def test_bad_requests_are_400_naming_the_parameter(client: OpenAI, call: Any, param: str, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        call(client)
    assert err.value.param == param, err.value.body
    assert fragment in err.value.message


def test_a_failed_job_is_500_and_not_retried(client: OpenAI, api: httpx.Client) -> None:
    def broken_jobs() -> int:
        return sum(j["pipeline"] == "broken-model" for j in api.get("/v1/jobs", params={"limit": 100}).json()["data"])

    before = broken_jobs()
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="broken-model", messages=[{"role": "user", "content": "hi"}])
    assert err.value.code == "job_failed" and "/nonexistent/omni-model" in err.value.message
    assert err.value.response.headers["x-should-retry"] == "false"
    assert broken_jobs() == before + 1  # the client (max_retries=2) did not submit it again
