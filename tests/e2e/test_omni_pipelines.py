"""The omni pipelines end to end: HTTP API, real Celery workers, vLLM, diffusers, Redis and moto S3.

Each built-in pipeline runs through the API and the workers and its real outputs are checked
(image size and mode, WAV header, text, tensor shapes of what the stages handed over). Then the
same request runs in this process through ``omni_jobs.Omni`` (same stage code and engines, no
broker, no Redis) and every output file must be byte-identical to the queued one (a video: the same
pictures, since x264 does not give the same bytes every time).
"""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from PIL import Image

from omni_jobs.artifacts import ArtifactRef, ArtifactStore, artifact_store_from_settings, codecs, sha256_hex
from omni_jobs.artifacts.mp4 import decode_mp4
from omni_jobs.core.settings import Settings
from omni_jobs.engines.pool import EnginePool
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.local.embedded import EmbeddedSystem
from omni_jobs.local.tiny import LLAMA_HIDDEN_SIZE
from omni_jobs.omni import Omni, OmniResult
from omni_jobs.pipelines.catalogue import load_catalogue
from tests import media_files
from tests.e2e.conftest import models_dir
from tests.e2e.helpers import wait_for_job


def _test_image(width: int = 48, height: int = 40) -> bytes:
    """A deterministic RGB gradient with some texture, as PNG bytes."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x * y) % 256], axis=-1).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


IMAGE = _test_image()
IMAGE_DATA_URI = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
WAV_DATA_URI = "data:audio/wav;base64," + base64.b64encode(media_files.wav(1.0)).decode()
MP4_DATA_URI = "data:video/mp4;base64," + base64.b64encode(media_files.mp4(frames=8, fps=4.0)).decode()

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "text-to-text": ({"prompt": "Once upon a time"}, {"ar": {"max_tokens": 8}}),
    "text-to-image": ({"prompt": "a red fox in the snow"},
                      {"dit": {"height": 32, "width": 32, "num_inference_steps": 2, "seed": 5}}),
    "llm-conditioned-image": ({"prompt": "a lighthouse at dusk, oil painting"}, {"dit": {"seed": 7}}),
    "text-to-audio": ({"prompt": "rain on a tin roof"}, {"audio": {"duration_s": 0.25, "seed": 3}}),
    "image-to-image": ({"prompt": "make it blue", "image": IMAGE_DATA_URI}, {"dit": {"seed": 2, "strength": 0.5}}),
    "text-to-text-and-image": ({"prompt": "a cat on a sofa"}, {}),
    "text-to-video": ({"prompt": "a cat walking on a wall"}, {"video": {"seed": 4}}),
    "image-to-text": ({"image": IMAGE_DATA_URI}, {"vlm": {"max_tokens": 6}}),
    "image-to-text-to-image": ({"image": IMAGE_DATA_URI, "prompt": "Redraw it at night."},
                               {"vlm": {"max_tokens": 6}, "dit": {"height": 32, "width": 32, "seed": 1}}),
    "speech-to-text": ({"audio": WAV_DATA_URI}, {"asr": {"max_tokens": 6, "language": "en"}}),
    "omni-understanding": ({"prompt": "What do you hear and see?", "audio": WAV_DATA_URI, "video": MP4_DATA_URI},
                           {"thinker": {"max_tokens": 6}}),
    "omni-chat": ({"prompt": "Say something about this clip.", "audio": WAV_DATA_URI, "voice": "Ethan"},
                  {"thinker": {"max_tokens": 6}, "talker": {"max_tokens": 60}}),
    "text-to-speech": ({"prompt": "Good morning."}, {"talker": {"max_tokens": 60}}),
}


def png(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    assert image.format == "PNG"
    return image


def by_name(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["name"]: o for o in job["outputs"]}


def run_queued(api: httpx.Client, pipeline: str, inputs: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    response = api.post("/v1/jobs", json={"pipeline": pipeline, "input": inputs, "params": params})
    assert response.status_code == 202, response.text
    job = wait_for_job(api, response.json()["id"])
    assert job["status"] == "succeeded", job["error"]
    return job


def download(url: str) -> bytes:
    return httpx.get(url, timeout=30).raise_for_status().content


@pytest.fixture(scope="module")
def system_artifacts(system: EmbeddedSystem) -> Iterator[ArtifactStore]:
    """The system's artifact store (moto S3 + Redis DB 3), to read what stages handed each other."""
    env = system.extra_env
    settings = Settings(
        artifact_backend="s3", s3_endpoint_url=env["OMNI_S3_ENDPOINT_URL"], s3_bucket=env["OMNI_S3_BUCKET"],
        s3_access_key_id="testing", s3_secret_access_key="testing",
        redis_artifact_max_bytes=int(env["OMNI_REDIS_ARTIFACT_MAX_BYTES"]),
    )
    assert system.redis_url is not None
    client = redis.Redis.from_url(system.redis_url)
    yield artifact_store_from_settings(settings, redis_client=client)
    client.close()


@pytest.fixture(scope="module")
def omni_parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Settings, EnginePool, MemoryJobStore]:
    """What every in-process Omni of this module shares: the models of the system, one engine pool."""
    settings = Settings(models_dir=models_dir(), artifacts_dir=tmp_path_factory.mktemp("omni-artifacts"))
    engines = EnginePool(settings.models_dir, kv_cache_bytes=settings.ar_kv_cache_bytes,
                          max_model_len=settings.ar_max_model_len, device=settings.device)
    return settings, engines, MemoryJobStore()


def run_in_process(parts: tuple[Settings, EnginePool, MemoryJobStore], pipeline: str, inputs: dict[str, Any],
                   params: dict[str, Any]) -> OmniResult:
    settings, engines, store = parts
    return Omni(pipeline, settings=settings, engines=engines, store=store).generate(inputs, params)


def test_every_builtin_pipeline_has_a_case() -> None:
    assert set(CASES) == set(load_catalogue().names())


@pytest.mark.parametrize("pipeline", sorted(CASES))
def test_in_process_result_equals_queued_result(
    api: httpx.Client, omni_parts: tuple[Settings, EnginePool, MemoryJobStore], pipeline: str
) -> None:
    inputs, params = CASES[pipeline]
    queued = run_queued(api, pipeline, inputs, params)
    local = run_in_process(omni_parts, pipeline, inputs, params)

    assert local.job.status.value == "succeeded"
    assert local.job.params == queued["params"]  # the same validated per-stage parameters were in force
    queued_outputs = by_name(queued)
    assert set(local.outputs) == set(queued_outputs) == {o.name for o in load_catalogue().get(pipeline).outputs}
    for name, out in local.outputs.items():
        entry = out.entry.model_dump(mode="json", exclude={"artifact", "url"}, exclude_none=True)
        queued_entry = {k: v for k, v in queued_outputs[name].items() if k != "url"}
        data = download(queued_outputs[name]["url"])
        if entry.get("type") == "video":  # x264 is not byte-reproducible every time: compare the pictures
            entry.pop("size"), queued_entry.pop("size")
            (here, _), (there, _) = decode_mp4(out.data), decode_mp4(data)
            assert here.shape == there.shape and np.abs(here.astype(int) - there.astype(int)).mean() < 2, name
        else:
            assert out.data == data, f"{pipeline}: output '{name}' differs"
        assert entry == queued_entry, name


def test_llm_conditioned_image_hands_hidden_states_to_the_dit(
    api: httpx.Client, system_artifacts: ArtifactStore
) -> None:
    from transformers import AutoTokenizer

    prompt = "a lighthouse at dusk, oil painting"
    job = run_queued(api, "llm-conditioned-image", {"prompt": prompt}, {"dit": {"height": 48, "width": 32}})
    encoder, dit = job["stages"]
    assert (encoder["id"], encoder["engine"], dit["id"]) == ("encoder", "ar", "dit")
    assert encoder["worker"].startswith("ar@") and dit["worker"].startswith("dit@")
    assert job["params"]["dit"]["height"] == 48 and job["params"]["encoder"] == {"prompt_template": "{prompt}"}

    # What the AR stage handed over: one hidden state per prompt token, of the LLM's hidden size.
    ref = ArtifactRef.model_validate(encoder["outputs"]["hidden_states"])
    assert ref.media_type == "application/vnd.safetensors" and ref.key.endswith("/encoder/attempt-1/hidden_states.safetensors")
    tensors = codecs.decode_tensors(system_artifacts.get(ref))
    tokens = len(AutoTokenizer.from_pretrained(models_dir() / "tiny-llama")(prompt)["input_ids"])
    assert list(tensors) == ["hidden_states"]
    hidden = tensors["hidden_states"]
    assert tuple(hidden.shape) == (tokens, LLAMA_HIDDEN_SIZE) and str(hidden.dtype) == "torch.float32"
    assert float(hidden.std()) > 0

    outputs = by_name(job)
    image = png(download(outputs["image"]["url"]))
    assert image.size == (32, 48) and image.mode == "RGB" and len(set(image.getdata())) > 50
    latents_out = outputs["latents"]
    assert (latents_out["type"], latents_out["media_type"]) == ("latents", "application/vnd.safetensors")
    latents = codecs.decode_tensors(download(latents_out["url"]))["latents"]
    # PixArt latents: 4 channels at 1/4 of the image size (the tiny VAE's factor).
    assert list(latents.shape) == latents_out["shape"] == [4, 12, 8]


def test_llm_conditioned_image_follows_the_prompt(api: httpx.Client) -> None:
    """The hidden states really condition the DiT: same seed, other prompt, other image."""
    a = run_queued(api, "llm-conditioned-image", {"prompt": "a red apple"}, {})
    b = run_queued(api, "llm-conditioned-image", {"prompt": "a blue ocean wave"}, {})
    assert download(by_name(a)["image"]["url"]) != download(by_name(b)["image"]["url"])


def test_text_to_audio_writes_a_wav(api: httpx.Client) -> None:
    job = run_queued(api, "text-to-audio", {"prompt": "rain on a tin roof"}, {"audio": {"duration_s": 0.75}})
    assert job["params"]["audio"]["duration_s"] == 0.75 and job["params"]["audio"]["num_inference_steps"] == 3
    outputs = by_name(job)
    assert outputs["text"]["text"]
    audio = outputs["audio"]
    assert (audio["type"], audio["media_type"], audio["sample_rate"]) == ("audio", "audio/wav", 16000)
    assert audio["duration_s"] == pytest.approx(0.75)
    data = download(audio["url"])
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE" and len(data) == audio["size"]
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 16000, 12000)
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    assert samples.std() > 0  # a rendered waveform, not silence
    assert [s["engine"] for s in job["stages"]] == ["ar", "dit"]


def test_text_to_audio_duration_is_validated_against_the_stage(api: httpx.Client) -> None:
    body = {"pipeline": "text-to-audio", "input": {"prompt": "x"},
            "params": {"audio": {"duration_s": -1, "height": 32}}}
    detail = api.post("/v1/jobs", json=body).json()["detail"]
    assert {tuple(d["loc"]) for d in detail} == {("body", "params", "audio", "duration_s"),
                                                 ("body", "params", "audio", "height")}, detail


def test_image_to_image_takes_base64_multipart_and_stored_outputs(api: httpx.Client) -> None:
    params = {"dit": {"seed": 4, "strength": 0.6}}
    by_b64 = run_queued(api, "image-to-image", {"prompt": "make it blue", "image": IMAGE_DATA_URI}, params)
    response = api.post(
        "/v1/jobs/multipart",
        data={"pipeline": "image-to-image", "input": json.dumps({"prompt": "make it blue"}),
              "params": json.dumps(params)},
        files={"input.image": ("photo.png", IMAGE, "image/png")},
    )
    assert response.status_code == 202, response.text
    by_upload = wait_for_job(api, response.json()["id"])
    assert by_upload["status"] == "succeeded", by_upload["error"]

    for job in (by_b64, by_upload):
        stored = job["input"]["image"]
        assert (stored["width"], stored["height"], stored["media_type"]) == (48, 40, "image/png")
        assert stored["artifact"]["key"] == f"jobs/{job['id']}/inputs/image.png"
        out = by_name(job)["image"]
        assert (out["width"], out["height"]) == (48, 40)  # the input's size (a multiple of 4 for Chroma)
    first, second = (download(by_name(j)["image"]["url"]) for j in (by_b64, by_upload))
    assert first == second  # the same image, however it came
    edited = png(first)
    assert edited.size == (48, 40) and edited.mode == "RGB"
    assert first != IMAGE

    # The output of one job as the input of the next, by its URL; with an explicit output size.
    url = f"{api.base_url}/v1/jobs/{by_b64['id']}/outputs/image"
    chained = run_queued(api, "image-to-image", {"prompt": "now red", "image": {"url": url}},
                         {"dit": {"height": 32, "width": 32}})
    assert png(download(by_name(chained)["image"]["url"])).size == (32, 32)
    assert chained["input"]["image"]["artifact"]["sha256"] == sha256_hex(first)  # that very PNG was stored


@pytest.mark.parametrize(
    ("image", "fragment"),
    [
        ("data:image/png;base64,!!!", "not valid base64"),
        (base64.b64encode(b"not an image at all").decode(), "not an image PIL can read"),
        ("https://example.com/cat.png", "nothing is fetched from elsewhere"),
        ({"job_id": "job_doesnotexist", "output": "image"}, "does not exist"),
        (42, "must be an image"),
    ],
)
def test_bad_image_input_is_422_naming_the_field(api: httpx.Client, image: Any, fragment: str) -> None:
    body = {"pipeline": "image-to-image", "input": {"prompt": "x", "image": image}}
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert any(d["loc"] == ["body", "input", "image"] and fragment in d["msg"] for d in detail), detail


def test_multipart_errors_name_the_part(api: httpx.Client) -> None:
    response = api.post("/v1/jobs/multipart", data={"pipeline": "image-to-image", "input": "{not json"},
                        files={"input.image": ("a.png", IMAGE, "image/png")})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "input"]
    response = api.post("/v1/jobs/multipart", data={"pipeline": "image-to-image", "input": "{}"},
                        files={"input.image": ("a.png", IMAGE, "image/png")})
    assert response.status_code == 422
    assert [d["loc"] for d in response.json()["detail"]] == [["body", "input", "prompt"]]
    response = api.post("/v1/jobs/multipart", data={"pipeline": "image-to-image", "input": '{"prompt": "x"}'},
                        files={"input.image": ("a.gif", b"GIF89a broken", "image/gif")})
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert detail[0]["loc"] == ["body", "input", "image"] and "not an image PIL can read" in detail[0]["msg"]
    response = api.post("/v1/jobs/multipart", data={"pipeline": "image-to-image", "input": '{"prompt": "x"}',
                                                    "priority": "1"})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "priority"]


def test_text_to_text_and_image_returns_both(api: httpx.Client) -> None:
    job = run_queued(api, "text-to-text-and-image", {"prompt": "a cat on a sofa"}, {"dit": {"seed": 9}})
    ar, dit = job["stages"]
    # Both stages are entry stages: queued when the job was accepted, run by their own workers.
    assert ar["queued_at"] == dit["queued_at"] < min(ar["started_at"], dit["started_at"])
    assert ar["worker"].startswith("ar@") and dit["worker"].startswith("dit@")
    outputs = by_name(job)
    assert [o["name"] for o in job["outputs"]] == ["text", "image", "text_and_image"]
    text = outputs["text"]["text"]
    assert text and download(outputs["text"]["url"]) == json.dumps({"text": text}, ensure_ascii=False,
                                                                     separators=(",", ":")).encode()
    image_bytes = download(outputs["image"]["url"])
    assert png(image_bytes).size == (32, 32)
    bundle = outputs["text_and_image"]
    assert (bundle["type"], bundle["media_type"], bundle["width"], bundle["height"]) == (
        "text+image", "application/json", 32, 32)
    document = json.loads(download(bundle["url"]))
    assert document["text"] == text == bundle["text"]
    assert base64.b64decode(document["image"]["data"]) == image_bytes


def test_pipelines_endpoint_shows_tasks_modalities_and_output_types(api: httpx.Client) -> None:
    llm = api.get("/v1/pipelines/llm-conditioned-image").json()
    encoder, dit = llm["stages"]
    assert (encoder["task"], encoder["outputs"]) == ("encode", {"hidden_states": "hidden_states"})
    assert (dit["task"], dit["inputs"], dit["outputs"]) == (
        "text-to-image", {"prompt_embeds": "encoder.hidden_states"}, {"image": "image", "latents": "latents"})
    both = api.get("/v1/pipelines/text-to-text-and-image").json()
    assert both["outputs"][-1] == {"name": "text_and_image", "from": ["ar.text", "dit.image"], "type": "text+image"}
    assert api.get("/v1/pipelines/image-to-image").json()["inputs"]["image"]["type"] == "image"


def test_openapi_documents_the_multipart_route(api: httpx.Client) -> None:
    spec = api.get("/openapi.json").json()
    body = spec["paths"]["/v1/jobs/multipart"]["post"]["requestBody"]["content"]
    assert "input.image" in body["multipart/form-data"]["schema"]["properties"]

