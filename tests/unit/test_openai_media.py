"""Chat content parts with media (omni_jobs.accept.openai_content, through openai_requests.plan_chat): which
pipeline runs, which job input each part fills, the 400s naming the part, and the schema saying the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import yaml

from omni_jobs.accept.openai_content import content_inputs
from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.accept.openai_requests import ChatCompletionRequest, invalid_request, plan_chat
from omni_jobs.accept.openai_schema import request_schema
from omni_jobs.accept.submission import resolve_params, validate_input
from omni_jobs.core.errors import FieldError, InvalidRequest
from omni_jobs.pipelines.catalogue import PipelineCatalogue, load_catalogue
from omni_jobs.pipelines.limits import Limits
from tests.media_files import MEDIA_PIPELINE

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}}
VIDEO = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAIGZ0eXA="}}
TEXT = {"type": "text", "text": "What is in it?"}

TWO_VIEWS = {  # a vision-language stage whose image port is wired to two job inputs
    "name": "two-views", "description": "Front and back of a thing, described.",
    "inputs": {"prompt": {"type": "text", "required": False, "default": "Describe it."},
               "front": {"type": "image"}, "back": {"type": "image", "required": False}},
    "stages": [{"id": "vlm", "engine": "ar", "model": "tiny:qwen2.5-vl",
                "inputs": {"prompt": "input.prompt", "image": ["input.front", "input.back"]}}],
    "outputs": [{"name": "text", "from": "vlm.text"}],
}


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory: pytest.TempPathFactory) -> PipelineCatalogue:
    folder: Path = tmp_path_factory.mktemp("pipelines")
    (folder / "two-views.yaml").write_text(yaml.safe_dump(TWO_VIEWS))
    (folder / "media-inputs.yaml").write_text(yaml.safe_dump(MEDIA_PIPELINE))  # audio, video inputs no stage reads
    return load_catalogue([folder])


def body(*content: Any, model: str = "gpt-4o", **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": [*content]}], **fields}


def plan(catalogue: PipelineCatalogue, *content: Any, **fields: Any) -> Any:
    return plan_chat(catalogue, ChatCompletionRequest.model_validate(body(*content, **fields)))


def refusal(catalogue: PipelineCatalogue, *content: Any, **fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        plan(catalogue, *content, **fields)
    assert err.value.status == 400
    return err.value


def test_parts_fill_the_file_inputs_of_the_named_pipeline(catalogue: PipelineCatalogue) -> None:
    p = plan(catalogue, TEXT, IMAGE, model="image-to-text", max_tokens=5)
    assert p.spec.name == "image-to-text" and p.params[0] == {"vlm": {"max_tokens": 5}}
    assert p.input == {"prompt": "What is in it?", "image": IMAGE["image_url"]["url"]}
    assert p.input_origin == {"image": "messages[0].content[1]"}
    validate_input(p.spec, p.input)  # what the submitter takes

    omni = plan(catalogue, VIDEO, TEXT, AUDIO, IMAGE, model="omni-understanding")
    assert omni.input == {"prompt": "What is in it?", "video": VIDEO["video_url"]["url"],
                          "audio": {"data": AUDIO["input_audio"]["data"]}, "image": IMAGE["image_url"]["url"]}
    assert omni.input_origin == {"video": "messages[0].content[0]", "audio": "messages[0].content[2]",
                                 "image": "messages[0].content[3]"}

    alone = plan(catalogue, IMAGE, model="image-to-text")  # no text: the pipeline's default prompt
    assert alone.input == {"image": IMAGE["image_url"]["url"]}
    assert validate_input(alone.spec, alone.input)["image"] == IMAGE["image_url"]["url"]


def test_a_port_wired_to_several_inputs_takes_a_part_each(catalogue: PipelineCatalogue) -> None:
    inputs = content_inputs(catalogue.get("two-views"))
    assert inputs is not None and inputs.slots["image"] == ("front", "back") and inputs.required["image"] == 1
    second = {"type": "image_url", "image_url": "data:image/png;base64,AAAA"}  # vLLM's plain-string form too
    p = plan(catalogue, TEXT, IMAGE, second, model="two-views")
    assert (p.input["front"], p.input["back"]) == (IMAGE["image_url"]["url"], "data:image/png;base64,AAAA")
    err = refusal(catalogue, IMAGE, second, IMAGE, model="two-views")
    assert err.param == "messages[0].content[2]" and err.code == "unsupported_content"
    assert "takes 2 image inputs, and this is image part 3" in err.message


def test_any_other_model_is_chosen_by_the_media_in_the_messages(catalogue: PipelineCatalogue) -> None:
    assert plan(catalogue, TEXT, IMAGE).spec.name == "image-to-text"  # the conventional name
    assert plan(catalogue, TEXT, AUDIO).spec.name == "omni-understanding"  # an answer, not speech-to-text's transcript
    # (nor media-inputs, whose audio input no stage reads)
    assert plan(catalogue, TEXT, VIDEO, IMAGE).spec.name == "omni-understanding"
    assert plan(catalogue, TEXT, IMAGE, modalities=["image"]).spec.name == "image-to-image"
    assert plan(catalogue, TEXT, IMAGE, modalities=["text", "image"]).spec.name == "image-to-text-to-image"
    assert plan(catalogue, TEXT).spec.name == "text-to-text"  # unchanged without media
    err = refusal(catalogue, TEXT, VIDEO, modalities=["image"])
    assert err.param == "messages[0].content[1]" and "no model that outputs ['image'] takes one" in err.message


def test_a_part_the_pipeline_cannot_take_is_named_with_the_models_that_take_it(catalogue: PipelineCatalogue) -> None:
    err = refusal(catalogue, TEXT, IMAGE, model="text-to-text")
    assert err.param == "messages[0].content[1]" and err.code == "unsupported_content"
    assert "pipeline 'text-to-text' takes no image input" in err.message
    assert "models that take it: image-to-text, image-to-text-to-image, omni-chat, omni-understanding, two-views" in err.message
    err = refusal(catalogue, TEXT, AUDIO, model="image-to-text")
    assert err.param == "messages[0].content[1]" and "models that take it: omni-chat, omni-understanding, speech-to-text" in err.message
    err = refusal(catalogue, TEXT, AUDIO, model="media-inputs")
    assert err.param == "messages[0].content[1]" and "pipeline 'media-inputs' takes no audio input" in err.message
    assert plan(catalogue, TEXT, model="media-inputs").input == {"prompt": "What is in it?"}
    err = refusal(catalogue, TEXT, IMAGE, IMAGE, model="image-to-text")
    assert err.param == "messages[0].content[2]" and "models that take 2 image parts: two-views" in err.message


def test_what_the_messages_lack_is_a_400(catalogue: PipelineCatalogue) -> None:
    err = refusal(catalogue, TEXT, model="image-to-text")
    assert (err.param, err.code) == ("messages", "missing_content") and "needs an image part (image_url)" in err.message
    err = refusal(catalogue, AUDIO, model="omni-understanding")
    assert err.param == "messages" and "needs a prompt" in err.message


def test_a_streamed_chat_takes_media_the_same(catalogue: PipelineCatalogue) -> None:
    streamed = plan(catalogue, TEXT, IMAGE, model="image-to-text", stream=True, stream_options={"include_usage": True})
    assert streamed.input == plan(catalogue, TEXT, IMAGE, model="image-to-text").input


def test_the_submitters_refusal_names_the_part_it_came_from(catalogue: PipelineCatalogue) -> None:
    p = plan(catalogue, TEXT, IMAGE, model="image-to-text")
    refused = InvalidRequest([FieldError(("input", "image"), "is a data: URI of audio/wav, not an image",
                                         "invalid_image")])
    err = invalid_request(refused, p)
    assert (err.param, err.code) == ("messages[0].content[1]", "invalid_image")
    prompt = invalid_request(InvalidRequest([FieldError(("input", "prompt"), "too long", "too_long")]), p)
    assert prompt.param == "messages"


@pytest.mark.parametrize(("content", "fields", "accepted"), [
    ([TEXT, IMAGE], {"model": "image-to-text"}, True),
    ([IMAGE], {"model": "image-to-text"}, True),
    ([TEXT], {"model": "image-to-text"}, False),
    ([TEXT, IMAGE, IMAGE], {"model": "image-to-text"}, False),
    ([TEXT, {"type": "image_url", "image_url": {"url": "x", "detail": "max"}}], {"model": "image-to-text"}, False),
    ([TEXT, AUDIO], {"model": "image-to-text"}, False),
    ([TEXT, AUDIO, VIDEO, IMAGE], {"model": "omni-understanding"}, True),
    ([AUDIO], {"model": "omni-understanding"}, False),
    ([TEXT, {"type": "input_audio", "input_audio": {"data": "x", "format": "pcm16"}}], {}, False),
    ([TEXT, AUDIO], {}, True),
    ([TEXT, AUDIO, AUDIO], {}, False),
    ([TEXT, IMAGE], {"modalities": ["image"]}, True),
    ([TEXT, VIDEO], {"modalities": ["image"]}, False),
    ([TEXT, IMAGE], {"model": "text-to-text"}, False),
    ([AUDIO], {"model": "speech-to-text", "max_tokens": 8}, True),
    ([AUDIO], {"model": "speech-to-text", "top_p": 0.5}, False),  # its stage takes no top_p
    ([TEXT, IMAGE, {"type": "image_url", "image_url": "data:,"}], {"model": "two-views"}, True),
    ([TEXT, IMAGE, IMAGE, IMAGE], {"model": "two-views"}, False),
])
def test_the_schema_and_the_mapping_agree_on_media(catalogue: PipelineCatalogue, content: list[Any],
                                                   fields: dict[str, Any], accepted: bool) -> None:
    base = ChatCompletionRequest.model_json_schema(ref_template="#/$defs/{model}")
    schema = {**request_schema("ChatCompletionRequest", base, catalogue, Limits()), "$defs": base.get("$defs", {})}
    request = body(*content, **fields)
    assert jsonschema_rs.validator_for(schema).is_valid(request) == accepted
    try:
        p = plan_chat(catalogue, ChatCompletionRequest.model_validate(request))
        resolve_params(p.spec, p.params[0])
    except (OpenAIError, InvalidRequest):
        assert not accepted
    else:
        assert accepted


def test_media_in_another_role_or_a_second_message_is_in_the_schema_too(catalogue: PipelineCatalogue) -> None:
    base = ChatCompletionRequest.model_json_schema(ref_template="#/$defs/{model}")
    validator = jsonschema_rs.validator_for(
        {**request_schema("ChatCompletionRequest", base, catalogue, Limits()), "$defs": base.get("$defs", {})})
    two_messages = {"model": "image-to-text", "messages": [{"role": "user", "content": [IMAGE]},
                                                           {"role": "user", "content": [IMAGE]}]}
    assistant = {"model": "image-to-text", "messages": [{"role": "assistant", "content": [TEXT, IMAGE]}]}
    split = {"model": "omni-understanding", "messages": [{"role": "user", "content": [IMAGE]},
                                                         {"role": "user", "content": "And this?"}]}
    for request, accepted in ((two_messages, False), (assistant, False), (split, True)):
        assert validator.is_valid(request) == accepted
        try:
            plan_chat(catalogue, ChatCompletionRequest.model_validate(request))
        except OpenAIError:
            assert not accepted
        else:
            assert accepted
