"""omni_jobs.accept.openai_requests, openai_schema and openai_responses: OpenAI requests to (pipeline, input,
params), finished jobs to answers."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
import pytest
from pydantic import ValidationError

from omni_jobs.accept.openai_content import read_content
from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.accept.openai_requests import (
    ChatCompletionRequest,
    ImageGenerationRequest,
    SpeechRequest,
    plan_chat,
    plan_images,
    plan_speech,
)
from omni_jobs.accept.openai_responses import chat_completion, finished, image_items, images_response
from omni_jobs.accept.openai_schema import request_schema
from omni_jobs.accept.submission import resolve_params
from omni_jobs.core.errors import InvalidRequest
from omni_jobs.jobs.models import Job, JobError, JobOutput, JobStatus
from omni_jobs.pipelines.catalogue import PipelineCatalogue, load_catalogue
from omni_jobs.pipelines.limits import Limits
from omni_jobs.pipelines.params import SEED_MAX


@pytest.fixture(scope="module")
def catalogue() -> PipelineCatalogue:
    return load_catalogue()


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def test_chat_picks_text_to_text_and_maps_sampling_to_the_ar_stage(catalogue: PipelineCatalogue) -> None:
    plan = plan_chat(catalogue, chat(max_tokens=7, temperature=0.5))
    assert plan.spec.name == "text-to-text" and plan.input == {"prompt": "hi"} and plan.wanted == ["text"]
    (params,) = plan.params
    ar = next(s.id for s in plan.spec.stages if s.engine == "ar")
    assert params[ar] == {"max_tokens": 7, "temperature": 0.5}
    assert plan.origin[(ar, "max_tokens")] == "max_tokens" and plan.prompt_param == "messages"


def test_chat_image_modality_picks_an_image_pipeline_with_the_size(catalogue: PipelineCatalogue) -> None:
    plan = plan_chat(catalogue, chat(modalities=["image"], size="64x48"))
    assert plan.spec.name == "text-to-image"
    dit = next(s.id for s in plan.spec.stages if s.engine == "dit")
    assert (plan.params[0][dit]["width"], plan.params[0][dit]["height"]) == (64, 48)


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": None, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "modalities": ["image"]}, "stream"),
    ({"size": "big", "modalities": ["image"]}, "size"),
    ({"model": "text-to-text", "modalities": ["audio"]}, "modalities"),
    ({"audio": {"format": "ogg"}}, "audio.format"),
    ({"stream": True, "modalities": ["text", "audio"], "audio": {"format": "wav"}}, "audio.format"),  # pcm16 only
    ({"model": "omni-chat", "modalities": ["text", "audio"], "audio": {"voice": "alloy"}}, "audio.voice"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),  # one of two names: not both
    ({"size": "64x64", "width": 32, "modalities": ["image"]}, "size"),
    ({"size": "064x64", "modalities": ["image"]}, "size"),  # the spec's sizes have no leading zero
    ({"num_inference_steps": 4}, "num_inference_steps"),  # text-to-text has no stage that takes it
])
def test_chat_refusals_name_the_parameter(catalogue: PipelineCatalogue, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as err:
        plan_chat(catalogue, chat(**fields))
    assert err.value.status == 400 and err.value.param == param
    assert err.value.body()["error"]["param"] == param


def test_messages_hold_text_and_user_messages_media() -> None:
    def messages(*contents: Any, role: str = "user") -> list[Any]:
        return ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": role, "content": c} for c in contents]}).messages

    assert read_content(messages("hello")).prompt == "hello"
    assert read_content(messages([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])).prompt == "a\nb"
    assert read_content(messages("q", "a")).prompt == "User: q\nUser: a\nAssistant:"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO", "detail": "low"}}
    alone = read_content(messages([image]))  # a user message may hold media only: no text, no transcript line
    assert alone.prompt is None and [(p.kind, p.value, p.param) for p in alone.media] == [
        ("image", "data:image/png;base64,iVBO", "messages[0].content[0]")]
    assert read_content(messages([image], "what is it?")).prompt == "what is it?"
    for bad, param in [("  ", "messages[1].content"), ([], "messages[1].content"),
                       ([{"type": "text", "text": " "}], "messages[1].content[0].text"),
                       ([{"type": "text"}], "messages[1].content[0].text"),
                       ([{"type": "file", "file": {"file_id": "x"}}], "messages[1].content[0]"),
                       ([{"type": "image_url", "image_url": {"url": ""}}], "messages[1].content[0].image_url.url"),
                       ([{"type": "image_url", "image_url": 7}], "messages[1].content[0].image_url"),
                       ([{"type": "image_url", "image_url": {"url": "x", "detail": "max"}}],
                        "messages[1].content[0].image_url.detail"),
                       ([{"type": "input_audio", "input_audio": {"data": "UklG"}}],
                        "messages[1].content[0].input_audio.format"),
                       ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
                        "messages[1].content[0].input_audio.data"),
                       ([{"type": "video_url"}], "messages[1].content[0].video_url")]:
        with pytest.raises(OpenAIError) as err:
            read_content(messages("ok", bad))  # one message without text is refused, not skipped
        assert (err.value.status, err.value.param) == (400, param)
    with pytest.raises(OpenAIError, match="user messages only") as err:
        read_content(messages([{"type": "text", "text": "x"}, image], role="assistant"))
    assert err.value.param == "messages[0].content[1]"


def test_images_run_n_jobs_with_consecutive_seeds(catalogue: PipelineCatalogue) -> None:
    body = ImageGenerationRequest.model_validate({"prompt": "a fox", "n": 3, "seed": 10})
    plan = plan_images(catalogue, body, max_outputs=10)
    dit = next(s.id for s in plan.spec.stages if s.engine == "dit")
    assert [p[dit]["seed"] for p in plan.params] == [10, 11, 12]
    with pytest.raises(OpenAIError, match="OMNI_MAX_OUTPUTS"):
        plan_images(catalogue, body, max_outputs=2)


def test_seeds_of_n_images_wrap_past_the_largest(catalogue: PipelineCatalogue) -> None:
    plan = plan_images(catalogue, ImageGenerationRequest.model_validate({"prompt": "a fox", "n": 2, "seed": SEED_MAX}),
                       max_outputs=10)
    dit = next(s.id for s in plan.spec.stages if s.engine == "dit")
    assert [p[dit]["seed"] for p in plan.params] == [SEED_MAX, 0]


def test_numbers_are_taken_as_their_schema_types_them() -> None:
    assert chat(max_tokens=7.0, temperature=1).max_tokens == 7  # 7.0 is an integer in JSON Schema
    for bad in ({"max_tokens": "7"}, {"max_tokens": 7.5}, {"width": True}, {"temperature": "0.5"}):
        with pytest.raises(ValidationError):
            chat(**bad)


@pytest.mark.parametrize(("fields", "accepted"), [
    ({}, True),
    ({"max_tokens": 4096}, True),
    ({"max_tokens": 4097}, False),
    ({"model": "text-to-image", "modalities": ["image"], "size": "64x48", "seed": 3}, True),
    ({"model": "text-to-image", "modalities": ["image"], "size": "60x48"}, False),
    ({"model": "text-to-image"}, True),  # text-to-image also answers its AR stage's text
    ({"model": "text-to-video"}, False),
    ({"modalities": ["image", "audio"]}, False),
    ({"modalities": ["audio"], "negative_prompt": "rain"}, True),
    ({"guidance_scale": 2.0}, False),
    ({"model": "llm-conditioned-image", "modalities": ["image"], "negative_prompt": "x"}, False),
    ({"params": {"ar": {"prompt_template": "Q: {prompt}"}}}, True),
])
def test_the_chat_schema_and_the_mapping_agree(catalogue: PipelineCatalogue, fields: dict[str, Any],
                                               accepted: bool) -> None:
    base = ChatCompletionRequest.model_json_schema(ref_template="#/$defs/{model}")
    schema = {**request_schema("ChatCompletionRequest", base, catalogue, Limits()), "$defs": base.get("$defs", {})}
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "a fox"}], **fields}
    assert jsonschema_rs.validator_for(schema).is_valid(body) == accepted
    try:
        plan = plan_chat(catalogue, ChatCompletionRequest.model_validate(body))
        resolve_params(plan.spec, plan.params[0])
    except OpenAIError:
        assert not accepted
    except InvalidRequest:
        assert not accepted
    else:
        assert accepted


def speech(**fields: Any) -> SpeechRequest:
    return SpeechRequest.model_validate({"model": "tts-1", "input": "hello", **fields})


def test_speech_is_mp3_by_default_in_any_of_openais_formats(catalogue: PipelineCatalogue) -> None:
    plan = plan_speech(catalogue, speech(voice="alloy"))  # text-to-audio has no voice input: any voice, unused
    assert plan.spec.name == "text-to-audio" and plan.input == {"prompt": "hello"} and plan.prompt_param == "input"
    assert plan.audio_format == "mp3"
    for fmt in ("mp3", "opus", "aac", "flac", "wav", "pcm"):
        assert plan_speech(catalogue, speech(response_format=fmt)).audio_format == fmt
    with pytest.raises(OpenAIError, match="response_format must be one of mp3, opus, aac, flac, wav, pcm") as err:
        plan_speech(catalogue, speech(response_format="ogg"))
    assert err.value.param == "response_format"


def test_speech_voice_is_the_pipelines_voice_input(catalogue: PipelineCatalogue) -> None:
    plan = plan_speech(catalogue, speech(model="text-to-speech", voice="Ethan", response_format="wav"))
    assert plan.input == {"prompt": "hello", "voice": "Ethan"} and plan.audio_format == "wav"
    assert plan_speech(catalogue, speech(model="text-to-speech", voice={"id": "Chelsie"})).input["voice"] == "Chelsie"
    assert "voice" not in plan_speech(catalogue, speech(model="text-to-speech")).input  # the input's default
    for voice in ("alloy", "ethan", {"name": "Ethan"}):
        with pytest.raises(OpenAIError) as err:
            plan_speech(catalogue, speech(model="text-to-speech", voice=voice))
        assert err.value.status == 400 and err.value.param == "voice"
        assert "voices: Chelsie, Ethan" in err.value.message


def test_chat_audio_voice_and_format(catalogue: PipelineCatalogue) -> None:
    plan = plan_chat(catalogue, chat(model="omni-chat", modalities=["text", "audio"],
                                     audio={"voice": "Ethan", "format": "flac"}))
    assert plan.input == {"prompt": "hi", "voice": "Ethan"} and plan.audio_format == "flac"
    assert plan.wanted == ["text", "audio"] and plan.input_origin["voice"] == "audio.voice"
    assert plan_chat(catalogue, chat(model="omni-chat", modalities=["text", "audio"])).audio_format == "wav"
    assert plan_chat(catalogue, chat(model="omni-chat", modalities=["text", "audio"],
                                     audio={"format": "pcm16"})).audio_format == "pcm"
    streamed = plan_chat(catalogue, chat(model="omni-chat", modalities=["text", "audio"], stream=True,
                                         audio={"voice": "Chelsie"}))
    assert streamed.audio_format == "pcm" and streamed.input["voice"] == "Chelsie"


def job(status: JobStatus = JobStatus.succeeded, **fields: Any) -> Job:
    return Job.model_validate({"id": "job_1", "pipeline": "text-to-image", "status": status, "input": {},
                               "stages": [], "created_at": 100.0, "completed_at": 101.0, **fields})


def output(name: str, type_: str, **fields: Any) -> JobOutput:
    ref = {"backend": "redis", "key": f"k/{name}", "media_type": "x/y", "size": 1, "sha256": "0" * 64}
    return JobOutput.model_validate({"name": name, "type": type_, "media_type": "image/png", "size": 1,
                                     "artifact": ref, **fields})


def test_finished_answers_failure_and_timeout_in_openais_shape() -> None:
    ok = job()
    assert finished([ok], [ok], wait_s=1) == [ok]
    failed = job(JobStatus.failed, error=JobError(stage="dit", type="EngineError", message="boom"))
    with pytest.raises(OpenAIError) as err:
        finished([ok], [failed], wait_s=1)
    assert (err.value.status, err.value.code, err.value.headers()["x-should-retry"]) == (500, "job_failed", "false")
    with pytest.raises(OpenAIError) as err:
        finished([ok], [job(JobStatus.running)], wait_s=2)
    assert (err.value.status, err.value.code) == (504, "job_timeout") and "after 2s" in err.value.message
    with pytest.raises(OpenAIError, match="disappeared"):
        finished([ok], [None], wait_s=1)


def test_answers_from_a_finished_job(catalogue: PipelineCatalogue) -> None:
    done = job(outputs=[output("image", "image", width=64, height=48), output("text", "text", text="a fox")])
    plan = plan_chat(catalogue, chat(modalities=["text", "image"]))
    answer = chat_completion(plan, done, finish="stop", usage=None, data={"image": b"PNG"}, output_ttl_s=60)
    assert answer["id"] == "chatcmpl-job_1" and answer["model"] == plan.spec.name
    text, image = answer["choices"]
    assert text["message"]["content"] == "a fox"
    assert image["message"]["content"] == [{"type": "image_url", "image_url": {"url": "data:image/png;base64,UE5H"}}]
    items = image_items(done, None, data={"image": b"PNG"})
    assert items == [{"b64_json": "UE5H", "revised_prompt": "a fox"}]
    assert images_response([done], items) == {"created": 100, "data": items, "output_format": "png", "size": "64x48"}


def test_streamed_speech_pieces() -> None:
    import base64

    import numpy as np

    from omni_jobs.accept.openai_responses import STREAM_PIECE_BYTES, audio_delta_message, streamed_pcm, unsent_pcm
    from omni_jobs.run.audio_stream import AudioChunk

    clip = bytes(range(256)) * 500  # 64000 samples of 24 kHz pcm16
    assert b"".join(unsent_pcm(clip, 0, None)) == clip  # no delta came: the whole clip, in pieces
    assert max(len(p) for p in unsent_pcm(clip, 0, None)) == STREAM_PIECE_BYTES
    assert b"".join(unsent_pcm(clip, 1000, 24000)) == clip[2000:]
    assert b"".join(unsent_pcm(clip, 500, 12000)) == clip[2000:]  # deltas at 12 kHz: 500 samples are 1000 at 24
    assert unsent_pcm(clip, 64000, 24000) == []
    same = AudioChunk(pcm=b"\x01\x00\x02\x00", sample_rate=24000, start=0)
    assert streamed_pcm(same) == same.pcm
    tone = (np.sin(np.arange(1200) / 5) * 12000).astype("<i2").tobytes()
    assert len(streamed_pcm(AudioChunk(pcm=tone, sample_rate=12000, start=0))) == pytest.approx(2 * 2400, abs=64)
    assert audio_delta_message("audio_1", transcript="Hi") == {"audio": {"id": "audio_1", "transcript": "Hi"}}
    assert audio_delta_message("audio_1", data=b"\x00\x01") == {
        "audio": {"id": "audio_1", "data": base64.b64encode(b"\x00\x01").decode()}}
    assert audio_delta_message("audio_1", expires_at=7) == {"audio": {"id": "audio_1", "expires_at": 7}}


def test_speech_as_sse_events(catalogue: PipelineCatalogue) -> None:
    from omni_jobs.accept.openai_responses import speech_event

    assert plan_speech(catalogue, speech(model="text-to-speech", stream_format="sse", response_format="pcm")).sse
    assert not plan_speech(catalogue, speech(stream_format="audio")).sse
    with pytest.raises(OpenAIError) as err:
        plan_speech(catalogue, speech(stream_format="websocket"))
    assert err.value.param == "stream_format"
    assert speech_event("delta", audio=b"\x00\x01") == {"type": "speech.audio.delta", "audio": "AAE="}
    assert speech_event("done", usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}) == {
        "type": "speech.audio.done", "usage": {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7}}
    assert speech_event("done")["usage"] == {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
