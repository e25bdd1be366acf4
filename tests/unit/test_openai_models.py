"""A ``model`` on the OpenAI routes: a pipeline runs; one of OpenAI's names is chosen by what is asked;
any other name (a typo) is OpenAI's 404 model_not_found, never another pipeline's answer."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
import pytest

from api.main import create_app
from omni_jobs.accept.openai_audio import TranscriptionForm, form_body, plan_transcription
from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.accept.openai_requests import (
    ChatCompletionRequest,
    ImageGenerationRequest,
    SpeechRequest,
    plan_chat,
    plan_images,
    plan_speech,
)
from omni_jobs.accept.openai_schema import request_schema
from omni_jobs.core.settings import OPENAI_MODEL_NAMES, Settings
from omni_jobs.pipelines.catalogue import PipelineCatalogue, load_catalogue
from omni_jobs.pipelines.limits import Limits


@pytest.fixture(scope="module")
def catalogue() -> PipelineCatalogue:
    return load_catalogue()


def chat(model: str) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": model, "messages": [{"role": "user", "content": "hi"}]})


def _refused(call: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as refused:
        call()
    return refused.value


def test_an_unknown_model_is_404_model_not_found_on_every_route(catalogue: PipelineCatalogue) -> None:
    for call in (lambda: plan_chat(catalogue, chat("no-such-model")),
                 lambda: plan_images(catalogue, ImageGenerationRequest.model_validate(
                     {"prompt": "a fox", "model": "text-to-imag"}), max_outputs=10),
                 lambda: plan_speech(catalogue, SpeechRequest.model_validate({"model": "tts-2", "input": "hi"})),
                 lambda: plan_transcription(catalogue, TranscriptionForm("whisper-2"), "transcribe")):
        error = _refused(call)
        assert (error.status, error.code, error.param, error.type) == (404, "model_not_found", "model",
                                                                       "invalid_request_error")
        assert "does not exist" in error.message and "GET /v1/models" in error.message


def test_openais_names_and_no_model_choose_by_what_is_asked(catalogue: PipelineCatalogue) -> None:
    assert plan_chat(catalogue, chat("gpt-4o")).spec.name == "text-to-text"
    assert plan_images(catalogue, ImageGenerationRequest.model_validate({"prompt": "a fox"}),
                       max_outputs=10).spec.name == "text-to-image"
    assert plan_images(catalogue, ImageGenerationRequest.model_validate({"prompt": "a fox", "model": "dall-e-3"}),
                       max_outputs=10).spec.name == "text-to-image"
    assert plan_transcription(catalogue, TranscriptionForm("whisper-1"), "transcribe").spec.name == "speech-to-text"
    assert plan_chat(catalogue, chat("text-to-image")).spec.name == "text-to-image"  # a pipeline: that one


def test_the_aliases_are_a_setting(catalogue: PipelineCatalogue) -> None:
    assert plan_chat(catalogue, chat("house-model"), aliases=["house-model"]).spec.name == "text-to-text"
    assert _refused(lambda: plan_chat(catalogue, chat("gpt-4o"), aliases=[])).status == 404
    assert Settings(openai_model_aliases="a, b").openai_model_aliases == ["a", "b"]  # type: ignore[arg-type]
    assert Settings().openai_model_aliases == list(OPENAI_MODEL_NAMES)


def test_the_spec_takes_openais_names_and_no_other(catalogue: PipelineCatalogue) -> None:
    base = ChatCompletionRequest.model_json_schema(ref_template="#/$defs/{model}")
    schema = {**request_schema("ChatCompletionRequest", base, catalogue, Limits()), "$defs": base.get("$defs", {})}
    valid = jsonschema_rs.validator_for(schema).is_valid
    body = {"messages": [{"role": "user", "content": "a fox"}]}
    assert valid({**body, "model": "gpt-4o"}) and valid({**body, "model": "text-to-text"})
    assert not valid({**body, "model": "no-such-model"})
    form: Any = form_body(catalogue, Limits())["content"]
    model = jsonschema_rs.validator_for(form["multipart/form-data"]["schema"]["properties"]["model"])
    assert model.is_valid("whisper-1") and model.is_valid("speech-to-text") and not model.is_valid("whisper-2")


def test_the_spec_lists_the_404_on_every_route() -> None:
    paths = create_app(Settings(redis_url="redis://127.0.0.1:1/0")).openapi()["paths"]
    for path in ("/v1/chat/completions", "/v1/images/generations", "/v1/audio/speech", "/v1/audio/transcriptions",
                 "/v1/audio/translations"):
        assert "404" in paths[path]["post"]["responses"], path
