"""bench.speech's own parts: its arguments, its paired ratios and its table. (Its timings live in its output.)"""

from __future__ import annotations

from typing import Any

import pytest

from bench.speech import ArmTimes, paired, parse, ratios, table, talker_params, texts


def test_defaults_and_flags() -> None:
    args = parse([])
    assert (args.concurrency, args.codes, args.reps, args.system, args.direct) == ([1, 8, 16], 200, 2, True, True)
    args = parse(["--concurrency", "16", "1", "16", "--codes", "48", "--reps", "1", "--no-system"])
    assert (args.concurrency, args.codes, args.reps, args.system) == ([1, 16], 48, 1, False)
    for bad in (["--concurrency", "0"], ["--codes", "0"], ["--no-system", "--no-direct"]):
        with pytest.raises(SystemExit):
            parse(bad)


def test_both_arms_say_the_same_distinct_texts_of_the_asked_length() -> None:
    assert texts(16, 0) == texts(16, 0) and len(set(texts(16, 0))) == 16
    assert not set(texts(8, 0)) & set(texts(8, 1))
    assert talker_params(200) == {"talker": {"max_tokens": 200}}


def _arm(first: list[list[float]], whole: list[list[float]], rtf: list[list[float]] | None = None) -> dict[str, Any]:
    arm = ArmTimes()
    for i, (f, w) in enumerate(zip(first, whole, strict=True)):
        arm.add({"first_s": f, "whole_s": w, **({"rtf": rtf[i], "talker_s": 1.0 + i} if rtf else {})})
    return arm.summary()


def test_ratios_are_medians_of_per_repetition_ratios() -> None:
    rows = {
        "1": {"direct": _arm([[1.0], [2.0]], [[3.0], [4.0]], [[0.9], [1.1]]), "system": _arm([[1.5], [2.0]], [[3.0], [6.0]])},
        "16": {"direct": _arm([[2.0] * 16, [3.0] * 16], [[8.0] * 16, [8.0] * 16], [[1.0] * 16, [1.2] * 16]),
               "system": _arm([[3.0] * 16, [5.0] * 16], [[9.0] * 16, [12.0] * 16])},
    }
    r = ratios(rows)
    assert r["first_over_least_n"]["direct"]["16"] == pytest.approx((2.0 + 1.5) / 2)  # 2/1 and 3/2
    assert r["first_over_least_n"]["system"]["16"] == pytest.approx((2.0 + 2.5) / 2)
    assert r["system_over_direct"]["1"] == {"first": pytest.approx(1.25), "whole": pytest.approx(1.25)}
    assert paired([1.0, None], [2.0, 1.0]) == 0.5 and paired([], []) is None
    text = table({"config": {"codes": 200, "reps": 2}, "rows": rows, "ratios": r,
                  "code2wav_alone": {"chunk": 24, "rtf_p50": 0.97, "rtf_p90": 1.07, "batched": {"1": 0.85, "16": 0.3}}})
    assert "200 codes (4.00 s of speech)" in text
    assert "direct  N=16: 1.75x" in text and "system  N=16: 2.25x" in text
    assert "N= 16: first chunk 1.58, whole clip 1.31" in text
    assert "one stream p50 0.97, p90 1.07" in text and "N=16: 0.30 per chunk" in text
    assert "the talker's last code at N=1: 1.50 s, N=16: 1.50 s" in text
