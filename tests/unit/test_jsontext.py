"""omni_jobs.core.jsontext: standard JSON, the same values as the standard library reads and writes."""

from __future__ import annotations

import json
import math

import pytest

from omni_jobs.core import jsontext

VALUES = [
    {"b": 1, "a": [1.5, 1764568000.123456, -0.0, 1e-300, True, None], "é": "café ☕"},
    ["x", {"nested": {"deep": [1, 2, {"k": "v"}]}}],
    "plain",
    12,
]


@pytest.mark.parametrize("value", VALUES)
def test_dumps_reads_back_as_the_standard_library_writes(value: object) -> None:
    text = jsontext.dumps(value)
    assert json.loads(text) == value == jsontext.loads(text)
    assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def test_sorted_keys_as_the_codec_stores_fields() -> None:
    value = {"b": {"z": 1, "y": 2}, "a": 0}
    assert jsontext.dumps(value, sort_keys=True) == json.dumps(value, separators=(",", ":"), sort_keys=True)


@pytest.mark.parametrize("value", [{"n": 2**70}, {1: "int key"}, {"s": "half a pair \ud83d"}])
def test_what_orjson_refuses_is_written_by_the_standard_library(value: object) -> None:
    text = jsontext.dumps(value)
    assert text == json.dumps(value, separators=(",", ":"))
    assert jsontext.loads(text) == json.loads(text)


def test_nan_is_null_and_old_nan_tokens_still_read() -> None:
    assert jsontext.dumps({"x": math.nan, "y": math.inf}) == '{"x":null,"y":null}'
    assert math.isnan(jsontext.loads('{"x": NaN}')["x"])
    assert jsontext.loads("[Infinity]") == [math.inf]


def test_bad_text_raises_the_standard_librarys_error() -> None:
    with pytest.raises(json.JSONDecodeError) as caught:
        jsontext.loads('{"pipeline": ')
    assert (caught.value.msg, caught.value.pos) == ("Expecting value", 13)


def test_bytes_are_utf8() -> None:
    assert jsontext.dumps_bytes({"p": "café"}) == '{"p":"café"}'.encode()
