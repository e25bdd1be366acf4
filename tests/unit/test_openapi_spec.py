"""The OpenAPI spec says what the submitter takes: a job's body per pipeline (built-in and the
user's own YAML), from the same rules that check it, with this server's settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import yaml
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from api.main import create_app
from api.routes.events import _start_after
from api.routes.jobs import cancel_after_pattern, parse_cancel_after
from omni_jobs.accept.submission import resolve_params, validate_input
from omni_jobs.core.errors import InvalidRequest
from omni_jobs.core.settings import Settings
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.pipelines.limits import Limits
from omni_jobs.pipelines.params import ARParams
from omni_jobs.pipelines.schema import AUDIO_SCHEMA, VIDEO_SCHEMA, params_schema
from omni_jobs.pipelines.spec import PipelineSpec
from tests import media_files as mf

CUSTOM = {
    "name": "my-story", "description": "A user's pipeline, from OMNI_PIPELINES_PATH.",
    "inputs": {"prompt": {"type": "text", "max_length": 50}, "words": {"type": "integer", "required": False}},
    "stages": [{"id": "writer", "engine": "ar", "model": "tiny:llama", "inputs": {"prompt": "input.prompt"},
                "defaults": {"max_tokens": 16}}],
    "outputs": [{"name": "text", "from": "writer.text"}],
}


def spec_of(**overrides: Any) -> dict[str, Any]:
    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0", **overrides))
    return app.openapi()


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("pipelines")
    (folder / "my-story.yaml").write_text(yaml.safe_dump(CUSTOM))
    (folder / "media-inputs.yaml").write_text(yaml.safe_dump(mf.MEDIA_PIPELINE))
    return spec_of(pipelines_path=[folder], max_steps=100)


def test_a_job_body_is_one_schema_per_pipeline_with_the_users_own(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    names = load_catalogue().names() + ["my-story", "media-inputs"]
    assert schemas["JobRequest"]["discriminator"]["mapping"] == {n: f"#/components/schemas/JobRequest.{n}"
                                                                 for n in sorted(names)}
    story = schemas["JobRequest.my-story"]["properties"]
    assert story["pipeline"]["const"] == "my-story"
    assert story["input"]["required"] == ["prompt"] and story["input"]["properties"]["prompt"]["maxLength"] == 50
    assert story["input"]["properties"]["words"]["anyOf"] == [{"type": "integer"}, {"type": "null"}]
    writer = story["params"]["anyOf"][0]["properties"]["writer"]["properties"]
    assert writer["max_tokens"]["default"] == 16 and writer["max_tokens"]["maximum"] == 4096
    dit = schemas["JobRequest.text-to-image"]["properties"]["params"]["anyOf"][0]["properties"]["dit"]["properties"]
    assert dit["num_inference_steps"]["maximum"] == 100  # OMNI_MAX_STEPS, not the model's 200
    form = spec["paths"]["/v1/jobs/multipart"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert "my-story" in form["schema"]["properties"]["pipeline"]["enum"]
    assert form["encoding"]["input"] == {"contentType": "application/json"}
    models = [route["properties"]["model"].get("const") for route in schemas["ChatCompletionRequest"]["oneOf"]]
    assert "my-story" in models


def test_webhooks_are_null_only_without_a_signing_secret(spec: dict[str, Any]) -> None:
    story = spec["components"]["schemas"]["JobRequest.my-story"]
    assert story["properties"]["webhook"]["type"] == "null" and "if" not in story
    signed = spec_of(webhook_secret="whsec_" + "A" * 32)["components"]["schemas"]["JobRequest.text-to-text"]
    assert "pattern" in signed["properties"]["webhook"] and "if" in signed


def test_audio_and_video_inputs_are_described_as_images_are(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    inputs = schemas["JobRequest.media-inputs"]["properties"]["input"]["properties"]
    assert inputs["speech"]["anyOf"] == [AUDIO_SCHEMA, {"type": "null"}] and inputs["speech"]["description"]
    assert inputs["clip"]["anyOf"] == [VIDEO_SCHEMA, {"type": "null"}]
    assert "invalid_audio" in AUDIO_SCHEMA["description"] and "invalid_video" in VIDEO_SCHEMA["description"]  # type: ignore[operator]
    form = spec["paths"]["/v1/jobs/multipart"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert {"input.speech", "input.clip"} <= set(form["properties"])
    branch = next(b for b in form["anyOf"] if b["properties"]["pipeline"] == {"const": "media-inputs"})
    assert branch["properties"]["input.speech"]["format"] == "binary"
    assert branch["properties"]["input.speech"]["description"].startswith("A file input, audio (WAV")
    assert branch["properties"]["input.clip"]["description"].startswith("A file input, a video (MP4")
    assert branch["properties"].get("input.image") is False  # another pipeline's file part


MEDIA = PipelineSpec.model_validate(mf.MEDIA_PIPELINE)


@pytest.mark.parametrize("input_", [
    {"prompt": "x", "speech": AUDIO_SCHEMA["examples"][0]},  # type: ignore[index]
    {"prompt": "x", "speech": {"job_id": "job_1", "output": "audio"}},
    {"prompt": "x", "clip": {"url": "http://a/v1/jobs/job_1/outputs/video"}},
    {"prompt": "x", "speech": None, "clip": None},
    {"prompt": "x", "speech": ""},
    {"prompt": "x", "speech": 5},
    {"prompt": "x", "clip": {"path": "/etc/passwd"}},
    {"prompt": "x", "clip": {"data": 3}},
])
def test_the_schema_and_the_submitter_agree_on_file_forms(spec: dict[str, Any], input_: dict[str, Any]) -> None:
    schema = spec["components"]["schemas"]["JobRequest.media-inputs"]
    valid = jsonschema_rs.validator_for(schema).is_valid({"pipeline": "media-inputs", "input": input_})
    try:
        validate_input(MEDIA, input_)
        accepted = True
    except InvalidRequest:
        accepted = False
    assert valid == accepted


@pytest.mark.parametrize(("input_", "params"), [
    ({"prompt": "a fox"}, None),
    ({"prompt": "   "}, None),
    ({"prompt": "x" * 2001}, None),
    ({"prompt": "a fox", "extra": 1}, None),
    ({}, None),
    ({"prompt": "a fox"}, {"dit": {"height": 64.0, "seed": 7}}),
    ({"prompt": "a fox"}, {"dit": {"height": "64"}}),
    ({"prompt": "a fox"}, {"dit": {"height": 60}}),
    ({"prompt": "a fox"}, {"dit": {"num_inference_steps": True}}),
    ({"prompt": "a fox"}, {"dit": {"guidance_scale": 1}}),
    ({"prompt": "a fox"}, {"ar": {"prompt_template": "Say: {prompt}"}}),
    ({"prompt": "a fox"}, {"ar": {"prompt_template": "{prompt} {prompt.upper}"}}),
    ({"prompt": "a fox"}, {"ar": {"prompt_template": "{{prompt}}"}}),
    ({"prompt": "a fox"}, {"nope": {}}),
])
def test_the_schema_and_the_submitter_agree(input_: dict[str, Any], params: Any) -> None:
    spec = load_catalogue().get("text-to-image")
    schema = spec_of()["components"]["schemas"]["JobRequest.text-to-image"]
    valid = jsonschema_rs.validator_for(schema).is_valid({"pipeline": spec.name, "input": input_, "params": params})
    try:
        validate_input(spec, input_)
        resolve_params(spec, params)
        accepted = True
    except InvalidRequest:
        accepted = False
    assert valid == accepted


def test_a_template_with_another_placeholder_is_refused_not_a_server_error() -> None:
    """Before, '{prompt} {prompt.upper}' passed the check and '{prompt.x}' raised AttributeError (a 500)."""
    with pytest.raises(ValueError, match="one placeholder is"):
        ARParams(prompt_template="{prompt} {prompt.x}")


def test_a_default_above_a_cap_must_be_overridden() -> None:
    schema = params_schema(load_catalogue().get("text-to-image"), Limits(max_steps=4))
    assert schema["required"] == ["dit"] and schema["properties"]["dit"]["required"] == ["num_inference_steps"]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([60.0, 86400.0, 604800.0]).flatmap(
    lambda max_s: st.tuples(st.just(max_s), st.from_regex(cancel_after_pattern(max_s)))))
def test_every_cancel_after_the_spec_lists_is_within_the_limit(case: tuple[float, str]) -> None:
    max_s, value = case
    assert 0 < parse_cancel_after(value) <= max_s


def test_both_event_ids_are_checked() -> None:
    assert _start_after("1-2", None) == "1-2" and _start_after(None, "3-4") == "3-4" and _start_after(None, None) == "0-0"
    with pytest.raises(InvalidRequest) as refused:
        _start_after("1-2", "null")
    assert [e.loc for e in refused.value.errors] == [("query", "after")]


def test_a_405_lists_every_method_of_the_path(tmp_path: Path) -> None:
    client = TestClient(create_app(Settings(redis_url="redis://127.0.0.1:1/0", artifacts_dir=tmp_path)))
    assert client.request("OPTIONS", "/v1/jobs").headers["allow"] == "GET, POST"
    assert client.request("OPTIONS", "/v1/jobs/multipart").headers["allow"] == "POST"
