"""OpenAI transcriptions and translations (omni_jobs.accept.openai_audio): the form, the job it runs, and the
answer in each response format from the speech stage's document."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
import pytest

from omni_jobs.accept.openai_audio import (
    TranscriptionForm,
    compression_ratio,
    form_body,
    plan_transcription,
    read_form,
    read_transcript,
    srt,
    timestamp,
    transcription_answer,
    vtt,
)
from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.accept.openai_requests import invalid_request
from omni_jobs.accept.submission import resolve_params, validate_input
from omni_jobs.core.errors import FieldError, InvalidRequest
from omni_jobs.pipelines.catalogue import PipelineCatalogue, load_catalogue
from omni_jobs.pipelines.limits import Limits

DOCUMENT = {  # what the speech stage writes (omni_jobs.engines.stage_exec.execute_transcribe)
    "text": "Hello there. General Kenobi.", "language": "en", "duration": 3.0, "task": "transcribe",
    "segments": [{"id": 0, "start": 0.0, "end": 1.5, "text": "Hello there."},
                 {"id": 1, "start": 1.5, "end": 3.0, "text": " General Kenobi."}],
    "finish_reason": "stop", "usage": {"prompt_tokens": 4, "completion_tokens": 9, "seconds": 3.0},
}


@pytest.fixture(scope="module")
def catalogue() -> PipelineCatalogue:
    return load_catalogue()


def test_the_form_is_read_naming_a_wrong_field() -> None:
    form = read_form([("model", "whisper-1"), ("language", "de"), ("temperature", "0.2"), ("prompt", "Namen"),
                      ("response_format", "srt"), ("timestamp_granularities[]", "segment"), ("stream", "false")])
    assert form == TranscriptionForm("whisper-1", "de", "Namen", 0.2, "srt")
    assert read_form([("model", "m")]).response_format == "json"
    for fields, param in [([], "model"), ([("model", "m"), ("model", "n")], "model"),
                          ([("model", "m"), ("response_format", "diarized_json")], "response_format"),
                          ([("model", "m"), ("temperature", "warm")], "temperature"),
                          ([("model", "m"), ("temperature", "nan")], "temperature"),
                          ([("model", "m"), ("timestamp_granularities[]", "word")], "timestamp_granularities[]"),
                          ([("model", "m"), ("stream", "true")], "stream"),
                          ([("model", "m"), ("chunking_strategy", "auto")], "chunking_strategy")]:
        with pytest.raises(OpenAIError) as err:
            read_form(fields)
        assert (err.value.status, err.value.param) == (400, param)


def test_a_transcription_is_a_speech_to_text_job(catalogue: PipelineCatalogue) -> None:
    plan = plan_transcription(catalogue, TranscriptionForm("whisper-1", "en", "Kenobi", 0.0), "transcribe")
    assert plan.spec.name == "speech-to-text" and plan.upload == "audio" and plan.input == {"prompt": "Kenobi"}
    assert plan.params == [{"asr": {"task": "transcribe", "language": "en", "temperature": 0.0}}]
    assert plan.input_origin == {"audio": "file"} and plan.origin[("asr", "language")] == "language"
    resolve_params(plan.spec, plan.params[0])
    validate_input(plan.spec, {**plan.input, "audio": b"RIFF"})  # the route adds the file's bytes

    translation = plan_transcription(catalogue, TranscriptionForm("speech-to-text"), "translate")
    assert translation.params == [{"asr": {"task": "translate"}}] and translation.input == {}


def test_a_pipeline_that_does_not_transcribe_is_refused_by_name(catalogue: PipelineCatalogue) -> None:
    with pytest.raises(OpenAIError) as err:
        plan_transcription(catalogue, TranscriptionForm("omni-understanding"), "transcribe")
    assert err.value.param == "model" and "these are: speech-to-text" in err.value.message
    plan = plan_transcription(catalogue, TranscriptionForm("whisper-1", language="english"), "transcribe")
    with pytest.raises(InvalidRequest) as refused:  # the stage's own check, named by the form's field
        resolve_params(plan.spec, plan.params[0])
    assert invalid_request(refused.value, plan).param == "language"
    bad_file = InvalidRequest([FieldError(("input", "audio"), "cannot be decoded", "invalid_audio")])
    assert (invalid_request(bad_file, plan).param, invalid_request(bad_file, plan).code) == ("file", "invalid_audio")


def test_timestamps_in_srt_and_vtt() -> None:
    assert timestamp(1.5, ",") == "00:00:01,500" and timestamp(3.0, ",") == "00:00:03,000"
    assert timestamp(3723.4567, ".") == "01:02:03.457" and timestamp(-0.001, ",") == "00:00:00,000"
    transcript = read_transcript(DOCUMENT)
    assert srt(transcript) == ("1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n"
                               "2\n00:00:01,500 --> 00:00:03,000\nGeneral Kenobi.\n\n")
    assert vtt(transcript) == ("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n\n"
                               "00:00:01.500 --> 00:00:03.000\nGeneral Kenobi.\n\n")


def test_each_response_format_from_the_document() -> None:
    transcript = read_transcript(DOCUMENT)
    body, media_type = transcription_answer(transcript, "json", temperature=0.0)
    assert body == {"text": DOCUMENT["text"], "usage": {"type": "duration", "seconds": 3.0}}
    assert media_type == "application/json"
    assert transcription_answer(transcript, "text", temperature=0.0) == (DOCUMENT["text"], "text/plain; charset=utf-8")
    assert transcription_answer(transcript, "vtt", temperature=0.0)[1] == "text/vtt; charset=utf-8"
    verbose, _ = transcription_answer(transcript, "verbose_json", temperature=0.4)
    assert isinstance(verbose, dict)
    assert {k: verbose[k] for k in ("task", "language", "duration", "text")} == {
        "task": "transcribe", "language": "en", "duration": 3.0, "text": DOCUMENT["text"]}
    first, second = verbose["segments"]  # type: ignore[misc]
    assert first == {"id": 0, "seek": 0, "start": 0.0, "end": 1.5, "text": "Hello there.", "tokens": [],
                     "temperature": 0.4, "avg_logprob": 0.0,
                     "compression_ratio": pytest.approx(compression_ratio("Hello there."), abs=1e-6),
                     "no_speech_prob": 0.0}
    assert second["seek"] == 150  # type: ignore[index]  # Whisper's 10 ms frames
    loop = "la " * 100
    assert compression_ratio(loop) > 2.4 > compression_ratio("Hello there.")  # Whisper's "repetitive" threshold
    undetected = read_transcript({**DOCUMENT, "language": None})
    assert transcription_answer(undetected, "verbose_json", temperature=0.0)[0]["language"] == "und"  # type: ignore[index]
    translated = read_transcript({**DOCUMENT, "language": "de", "task": "translate"})
    assert transcription_answer(translated, "verbose_json", temperature=0.0)[0]["language"] == "en"  # type: ignore[index]
    with pytest.raises(TypeError):
        read_transcript({"language": "en", "duration": 1.0})


@pytest.mark.parametrize(("fields", "accepted"), [
    ({"model": "whisper-1"}, True),
    ({"model": "speech-to-text", "language": "de", "temperature": 0.5, "prompt": "x", "response_format": "vtt"}, True),
    ({"model": "speech-to-text", "temperature": 2.5}, False),
    ({"model": "speech-to-text", "language": "german"}, False),
    ({"model": "speech-to-text", "response_format": "xml"}, False),
    ({"model": "text-to-text"}, False),
    ({"model": "speech-to-text", "timestamp_granularities[]": ["segment"]}, True),
    ({"model": "speech-to-text", "timestamp_granularities[]": ["word"]}, False),
    ({"model": "speech-to-text", "stream": True}, False),
    ({"model": "speech-to-text", "seed": 3}, False),
    ({}, False),
])
def test_the_form_schema_and_the_checks_agree(catalogue: PipelineCatalogue, fields: dict[str, Any],
                                              accepted: bool) -> None:
    schema = form_body(catalogue, Limits())["content"]["multipart/form-data"]["schema"]  # type: ignore[index]
    assert jsonschema_rs.validator_for(schema).is_valid({"file": "RIFF", **fields}) == accepted
    form_fields = [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, value in fields.items()
                   for v in (value if isinstance(value, list) else [value])]
    try:
        plan = plan_transcription(catalogue, read_form(form_fields), "transcribe")
        resolve_params(plan.spec, plan.params[0])
        validate_input(plan.spec, {**plan.input, "audio": b"RIFF"})
    except (OpenAIError, InvalidRequest):
        assert not accepted
    else:
        assert accepted
