"""The benchmark's looping measure: one repeated n-gram covering more than half of an output."""

from __future__ import annotations

from speculation.bench.engine import LOOP_MAX_N, is_looping, looping_share, repeated_ngram_coverage

NORMAL = (
    "Hawaii is a string of volcanic islands in the Pacific. On our first morning we walked to a small "
    "market, tasted fresh pineapple and learned a few words of the language from the woman who sold it; "
    "in the afternoon a guide took us up to the crater, where the wind was cold and the view went on for miles."
).split()


def test_a_greedy_loop_after_a_normal_start_counts_as_looping():
    text = NORMAL[:10] + "and then the end of the story and then the end of the story".split() * 3
    assert is_looping(text)
    assert repeated_ngram_coverage(text) > 0.6


def test_normal_prose_with_common_repeated_words_does_not_loop():
    assert repeated_ngram_coverage(NORMAL) < 0.2  # "the", "a", "of" repeat but cover little
    assert not is_looping(NORMAL)


def test_a_single_token_repeated_loops_and_overlapping_occurrences_count_once():
    assert repeated_ngram_coverage(list("xyzaaaaaaa")) == 0.7  # "a"*7: positions 3..9, overlaps counted once
    assert is_looping(["\n"] * 20 + list("abcdefghij"))


def test_the_threshold_is_more_than_half_of_the_output():
    half = list("abcdefgh") + list("xyxyxyxy")  # "xy" covers exactly 8 of 16 tokens
    assert repeated_ngram_coverage(half) == 0.5
    assert not is_looping(half)
    assert is_looping(half + ["x", "y"])


def test_long_period_loops_up_to_the_longest_n_gram_are_found():
    period = [f"w{i}" for i in range(LOOP_MAX_N)]  # a "sentence" of LOOP_MAX_N distinct tokens, said 3 times
    assert is_looping(period * 3)
    assert not is_looping(period)


def test_looping_share_is_the_share_of_looping_outputs():
    outputs = [NORMAL, list("abababababab"), NORMAL[5:], NORMAL[::-1]]
    assert looping_share(outputs) == 0.25
    assert looping_share([]) == 0.0


def test_the_looping_report_counts_per_length_and_category_and_measures_garbled_text():
    from speculation.bench.looping import garbled_share, summarize

    loop_late = NORMAL[:20] + ["x", "y"] * 20  # normal for 20 tokens, then a loop
    outputs = [("writing", NORMAL[:40]), ("writing", loop_late), ("coding", ["a"] * 40)]
    report = summarize(outputs, [20, 60], decode=" ".join)
    # at 20 tokens only the one-token loop loops; at 60 the late loop too
    assert report["looping_share"] == {"20": round(1 / 3, 4), "60": round(2 / 3, 4)}
    assert report["per_category"] == {"coding": {"prompts": 1, "looping": 1}, "writing": {"prompts": 2, "looping": 1}}
    assert report["samples"]["writing"].startswith("Hawaii is")
    assert report["garbled_share"] == 0.0
    assert garbled_share("ab\ufffd\x7f") == 0.25  # U+FFFD counts; DEL (127) is not a control code below 32
    assert garbled_share("a\x01\n\t") == 0.25  # newline and tab are text
