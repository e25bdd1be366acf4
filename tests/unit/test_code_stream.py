"""A talker's codes as deltas: written as growing text, read back attempt by attempt, a missed delta noticed."""

from __future__ import annotations

from omni_jobs.run.code_stream import CODES_FIELD, CodesFollower, codes_text, parse_codes


def _delta(codes: list[int], index: int, attempt: int = 1) -> dict:
    return {"stage": "talker", "output": "audio_codes", CODES_FIELD: codes_text(codes), "index": index,
            "attempt": attempt}


def test_codes_round_trip_and_the_text_only_grows() -> None:
    assert parse_codes(codes_text([812, 0, 33])) == [812, 0, 33]
    assert codes_text([1, 2, 3]).startswith(codes_text([1, 2]))


def test_a_follower_keeps_the_current_attempts_codes_and_notices_a_gap() -> None:
    follower = CodesFollower("talker", "audio_codes")
    assert follower.feed(_delta([5, 6], 0)) == (True, [5, 6])
    assert follower.feed({"stage": "thinker", "output": "text", "text": "hi", "index": 0}) == (False, [])
    assert follower.feed(_delta([7], 1)) == (False, [7]) and follower.codes == [5, 6, 7]
    assert follower.feed(_delta([1, 2], 0, attempt=2)) == (True, [1, 2]) and follower.codes == [1, 2]
    assert follower.feed(_delta([9], 2, attempt=2)) == (False, []) and not follower.whole  # index 1 was missed
