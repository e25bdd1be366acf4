"""A text input with ``choices`` (a voice of the checkpoint's): only those values pass, the schema says so as an
enum, the console offers them as a select, and a spec whose default is not one of them is refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.ui.forms import input_fields
from omni_jobs.accept.submission import validate_input
from omni_jobs.core.errors import InvalidRequest
from omni_jobs.pipelines.catalogue import load_catalogue
from omni_jobs.pipelines.schema import input_schema
from omni_jobs.pipelines.spec import InputField


def test_a_voice_outside_the_choices_is_refused_naming_the_field_and_the_choices() -> None:
    spec = load_catalogue().get("omni-chat")
    with pytest.raises(InvalidRequest) as err:
        validate_input(spec, {"prompt": "hi", "voice": "Alice"})
    (problem,) = err.value.errors
    assert problem.loc == ("input", "voice") and problem.type == "not_a_choice"
    assert "one of Chelsie, Ethan" in problem.message
    assert validate_input(spec, {"prompt": "hi", "voice": "Ethan"})["voice"] == "Ethan"
    assert validate_input(spec, {"prompt": "hi"})["voice"] == "Chelsie"  # the default


def test_the_schema_and_the_console_offer_the_choices() -> None:
    spec = load_catalogue().get("text-to-speech")
    voice = input_schema(spec)["properties"]["voice"]
    assert voice["anyOf"][0] == {"type": "string", "enum": ["Chelsie", "Ethan"]} and voice["default"] == "Chelsie"
    (field,) = [f for f in input_fields(spec) if f.name == "input.voice"]
    assert field.kind == "select" and field.choices == ("Chelsie", "Ethan") and field.value == "Chelsie"


def test_choices_are_for_text_and_hold_the_default() -> None:
    with pytest.raises(ValidationError, match="choices apply to text inputs"):
        InputField(type="integer", choices=("1",))
    with pytest.raises(ValidationError, match="default 'Bob' is not one of the choices"):
        InputField(type="text", choices=("Chelsie", "Ethan"), default="Bob")


def test_openai_sampling_fields_set_the_reply_not_the_talker() -> None:
    from omni_jobs.accept.openai_requests import CHAT_FIELDS, build_params

    spec = load_catalogue().get("omni-chat")
    params, _ = build_params(spec, CHAT_FIELDS, {"max_tokens": 8, "temperature": 0.5, "seed": 3}, None)
    assert params["thinker"] == {"max_tokens": 8, "temperature": 0.5, "seed": 3}
    assert params["talker"] == {"seed": 3} and params["code2wav"] == {"seed": 3}
