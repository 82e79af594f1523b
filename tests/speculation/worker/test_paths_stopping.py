"""The stop matcher (speculation.worker.paths.stopping) against vLLM 0.32's rules, without models or servers."""

from __future__ import annotations

import random

import pytest

from speculation.worker.paths.stopping import StopMatcher, StopRule, check_stop_strings

EOS = 0
PIECES = {EOS: "", 1: "def", 2: " f", 3: "(x", 4: "):", 5: "\n", 6: "    return", 7: " x", 8: "\n\n", 9: "#"}


def decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def run(ids: list[int], *, batches: list[int] | None = None, **fields) -> tuple[StopMatcher, list[int], list[str]]:
    """Feed ids in batches of the given sizes (default: all at once); (matcher, kept ids, text deltas)."""
    max_tokens = fields.pop("max_tokens", 64)
    rule = StopRule.from_fields(fields, max_tokens=max_tokens, eos_token_id=EOS, eos_ids=[EOS])
    matcher = StopMatcher(rule, decode=decode)
    kept: list[int] = []
    deltas: list[str] = []
    sizes = batches or [len(ids)]
    start = 0
    for size in sizes:
        batch = ids[start : start + size]
        start += size
        n, delta = matcher.feed(batch)
        kept += batch[:n]
        deltas.append(delta)
        if matcher.finished:
            break
    deltas.append(matcher.finish())
    return matcher, kept, deltas


SEQUENCE = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]  # "def f(x):\n    return x\n\n#def f"


def test_a_stop_string_spanning_tokens_cuts_the_text_and_drops_later_tokens():
    matcher, kept, deltas = run(SEQUENCE, stop=["x):"])  # spans "(x" and "):"
    assert kept == [1, 2, 3, 4]  # the token that completed the stop string is the last one
    assert "".join(deltas) == "def f("
    assert (matcher.finish_reason, matcher.stop_reason) == ("stop", "x):")


def test_include_stop_str_in_output_keeps_the_stop_string():
    matcher, kept, deltas = run(SEQUENCE, stop="x):", include_stop_str_in_output=True)
    assert "".join(deltas) == "def f(x):"
    assert matcher.stop_reason == "x):"


def test_of_several_stop_strings_the_one_completing_first_wins_whatever_the_order():
    matcher, kept, _ = run(SEQUENCE, stop=["\n\n", "return", "f("])
    assert matcher.stop_reason == "f("
    assert kept == [1, 2, 3]


def test_a_stop_at_the_first_token_gives_empty_text():
    matcher, kept, deltas = run(SEQUENCE, stop=["de"])
    assert kept == [1]
    assert "".join(deltas) == ""
    assert matcher.finish_reason == "stop"


def test_stop_token_ids_stop_with_the_id_as_reason_and_leave_its_text_out():
    matcher, kept, deltas = run(SEQUENCE, stop_token_ids=[5])
    assert kept == [1, 2, 3, 4, 5]
    assert "".join(deltas) == "def f(x):"
    assert (matcher.finish_reason, matcher.stop_reason) == ("stop", 5)
    _, _, deltas = run(SEQUENCE, stop_token_ids=[5], include_stop_str_in_output=True)
    assert "".join(deltas) == "def f(x):\n"


def test_the_end_token_stops_with_no_reason_unless_ignore_eos():
    ids = [1, 2, EOS, 3, 4]
    matcher, kept, _ = run(ids)
    assert kept == [1, 2, EOS]
    assert (matcher.finish_reason, matcher.stop_reason) == ("stop", None)
    matcher, kept, deltas = run(ids, ignore_eos=True)
    assert kept == ids
    assert "".join(deltas) == "def f(x):"
    assert matcher.finish_reason == "length"  # the loop ended (finish) without a stop


def test_max_tokens_ends_with_length_but_a_stop_string_at_the_last_token_wins():
    matcher, kept, _ = run(SEQUENCE, max_tokens=3)
    assert (kept, matcher.finish_reason) == ([1, 2, 3], "length")
    matcher, kept, _ = run(SEQUENCE, max_tokens=3, stop="f(")
    assert (kept, matcher.finish_reason, matcher.stop_reason) == ([1, 2, 3], "stop", "f(")


def test_min_tokens_hides_text_of_the_first_tokens_from_stop_strings_but_not_a_string_ending_later():
    # "def" is inside the first 2 tokens: not searched
    matcher, kept, _ = run(SEQUENCE, stop=["def"], min_tokens=2)
    assert kept == SEQUENCE[:10]  # found again only in the second "def" (token 10)
    assert matcher.stop_reason == "def"
    # " f(" begins inside min_tokens and ends in token 3: found there
    matcher, kept, _ = run(SEQUENCE, stop=[" f("], min_tokens=2)
    assert kept == [1, 2, 3]


@pytest.mark.parametrize("fields", [{"stop": ["x):"]}, {"stop": ["\n\n", "#d"]}, {"stop": "return x", "min_tokens": 3}])
def test_any_split_into_batches_gives_what_one_token_at_a_time_gives(fields):
    one_by_one = run(SEQUENCE, batches=[1] * len(SEQUENCE), **fields)
    rng = random.Random(0)
    for _ in range(50):
        sizes, left = [], len(SEQUENCE)
        while left:
            sizes.append(rng.randint(1, min(left, 6)))
            left -= sizes[-1]
        got = run(SEQUENCE, batches=sizes, **fields)
        assert got[1] == one_by_one[1]
        assert "".join(got[2]) == "".join(one_by_one[2])
        assert (got[0].finish_reason, got[0].stop_reason) == (one_by_one[0].finish_reason, one_by_one[0].stop_reason)


def test_a_stream_never_sends_text_that_later_turns_out_to_be_a_stop_string():
    # "\n\n#" spans three tokens; before the last one arrives, "\n\n" could still be the start of it
    _, _, deltas = run(SEQUENCE, batches=[1] * len(SEQUENCE), stop=["\n\n#"])
    sent = ""
    for delta in deltas:
        sent += delta
        assert "\n\n" not in sent
    assert sent == "def f(x):\n    return x"


def test_check_stop_strings_looks_back_only_as_far_as_a_stop_string_could_span():
    text = "abcXYdef"
    assert check_stop_strings(text, 3, ("XY",), False) is None  # wholly inside old text: already checked
    assert check_stop_strings(text, 4, ("XY",), False) == ("XY", 3)
    assert check_stop_strings(text, 4, ("Yd", "XYd"), True) == ("Yd", 6)  # same end: the order given
    assert check_stop_strings(text, 4, ("XYd", "Yd"), False) == ("XYd", 3)
    assert check_stop_strings(text, 1, ("ef",), True) == ("ef", -1)


def test_the_rule_suppresses_every_end_token_before_min_tokens_even_with_ignore_eos():
    rule = StopRule.from_fields(
        {"stop_token_ids": [7], "ignore_eos": True, "min_tokens": 2}, max_tokens=8, eos_token_id=0, eos_ids=[0, 9]
    )
    assert rule.suppressed_ids == {0, 7, 9}
    assert rule.stop_ids == {7}
    assert StopRule.from_fields({}, max_tokens=8, eos_token_id=0, eos_ids=[0, 9]).stop_ids == {0, 9}
