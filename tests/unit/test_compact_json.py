"""compact_json: the same values as the standard library's JSON, compact, and every value it takes."""

from __future__ import annotations

import json

import pytest

from omni_jobs import compact_json

VALUES: list[object] = [
    {"prompt": "a cat", "n": 3, "t": 0.7, "ok": True, "none": None, "list": [1, 2.5, "x"]},
    {"unicode": "snow ❄ and 猫", "escape": 'quote " backslash \\ newline \n tab \t'},
    [1796076454.6265361, 1e16, -0.0, 5e-324],
    "just a string",
]


@pytest.mark.parametrize("value", VALUES)
def test_it_decodes_to_the_standard_librarys_values_and_has_no_spaces(value: object) -> None:
    text = compact_json.dumps(value)
    assert json.loads(text) == value
    assert json.loads(compact_json.dumps_bytes(value)) == value
    assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def test_sort_keys_gives_one_text_for_one_value() -> None:
    assert compact_json.dumps({"b": 1, "a": {"d": 2, "c": 3}}, sort_keys=True) == '{"a":{"c":3,"d":2},"b":1}'
    assert compact_json.dumps({"b": 1, "a": 2}) == '{"b":1,"a":2}'


@pytest.mark.parametrize("value", [
    {"seed": 2**70},  # beyond 64 bits: orjson refuses, the standard library writes it
    {"text": "lone \ud800 surrogate"},  # what json.loads makes of "\\ud800" in a request body
    {1: "int key"},
])
def test_values_orjson_refuses_are_written_by_the_standard_library(value: dict[object, object]) -> None:
    text = json.dumps(value, separators=(",", ":"))  # ASCII: a lone surrogate escaped, so it can be sent
    assert compact_json.dumps(value) == text
    assert compact_json.dumps_bytes(value) == text.encode()


def test_nan_and_infinity_are_null_not_invalid_json() -> None:
    assert json.loads(compact_json.dumps([float("nan"), float("inf"), -float("inf")])) == [None, None, None]
