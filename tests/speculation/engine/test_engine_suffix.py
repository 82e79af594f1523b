"""Suffix decoding (speculation.engine.suffix): what it drafts from earlier responses, and that it learns from them."""

from __future__ import annotations

import pytest

from speculation.engine import GenerationConfig, LocalTarget, NgramProposer, SuffixIndex, SuffixProposer, generate
from speculation.engine.suffix import MAX_OCCURRENCES


def test_the_longest_matching_suffix_decides_and_its_continuation_is_drafted():
    index = SuffixIndex()
    index.add("a", [1, 2, 3, 4, 5, 6])
    index.add("b", [9, 3, 7, 7, 7])
    proposer = SuffixProposer(index)
    # "2 3" occurs only in a (b has "3" after 9): the two-token match wins over the one-token one
    assert proposer.lookup([8, 2, 3], 3) == [4, 5, 6]
    # only "3" matches (after 0): both occurrences vote; a tie goes to the latest (b)
    assert proposer.lookup([0, 3], 2) == [7, 7]
    # nothing matches: no draft
    assert proposer.lookup([42, 43], 4) == []
    assert proposer.lookup([], 4) == [] and proposer.lookup([1, 2], 0) == []


def test_the_continuation_most_earlier_answers_agree_on_is_drafted_and_a_weak_one_is_cut():
    index = SuffixIndex()
    for i in range(3):
        index.add(f"yes{i}", [5, 6, 10, 11, 12])
    index.add("no", [5, 6, 20, 21, 22])
    # 3 of 4 continue "5 6" with 10 11 12
    assert SuffixProposer(index).lookup([5, 6], 3) == [10, 11, 12]
    # a cut above 3/4: no draft at all
    assert SuffixProposer(index, min_token_prob=0.8).lookup([5, 6], 3) == []
    # the spec factor caps the draft at factor x the match length (2 tokens matched)
    assert SuffixProposer(index, max_spec_factor=1.0).lookup([5, 6], 5) == [10, 11]


def test_the_requests_own_context_is_looked_up_as_prompt_lookup_does():
    # an empty store: suffix decoding is prompt lookup with voting over the context's occurrences
    proposer = SuffixProposer(SuffixIndex())
    context = [1, 2, 3, 9, 1, 2, 3, 9, 4, 1, 2, 3]
    assert proposer.lookup(context, 2) == NgramProposer().lookup(context, 2) == [9, 4]


def test_exclude_leaves_one_stored_answer_out_and_old_answers_are_evicted():
    index = SuffixIndex(max_sequences=2)
    index.add("own", [1, 2, 3, 4])
    assert SuffixProposer(index, exclude="own").lookup([1, 2], 2) == []
    assert SuffixProposer(index).lookup([1, 2], 2) == [3, 4]
    index.add("second", [7, 8, 9])
    index.add("third", [5, 5, 6])  # over max_sequences: "own" goes
    assert "own" not in index and len(index) == 2
    assert SuffixProposer(index).lookup([1, 2], 2) == []
    assert SuffixProposer(index).lookup([7, 8], 1) == [9]
    index.add("second", [0, 0, 0])  # a key already stored stays as it was
    assert SuffixProposer(index).lookup([7, 8], 1) == [9]


def test_an_ngram_keeps_only_its_latest_occurrences():
    index = SuffixIndex()
    for i in range(MAX_OCCURRENCES + 10):
        index.add(f"r{i}", [1, 100 + i])
    found = index.occurrences((1,))
    assert len(found) == MAX_OCCURRENCES
    assert found[-1][0][1] == 100 + MAX_OCCURRENCES + 9  # the latest kept, last


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_sequences"):
        SuffixIndex(max_sequences=0)
    with pytest.raises(ValueError, match="min_token_prob"):
        SuffixProposer(min_token_prob=1.5)
    with pytest.raises(ValueError, match="max_spec_factor"):
        SuffixProposer(max_spec_factor=0)


def test_a_target_that_repeats_an_earlier_answer_accepts_long_drafts_from_the_store(target_model):
    # given the target's answer to one prompt stored; a second prompt ending the same way answers the same
    target = LocalTarget(target_model)
    config = GenerationConfig(max_new_tokens=40, k=6)
    first = generate(target, NgramProposer(), [1, 2, 3], config).tokens
    index = SuffixIndex()
    index.add("earlier", first)
    # when the same prompt comes again, drafted from the store vs prompt lookup alone
    warm = generate(target, SuffixProposer(index), [1, 2, 3], config)
    cold = generate(target, NgramProposer(), [1, 2, 3], config)
    # then: the same tokens; the store's drafts are mostly accepted (a token that occurs twice in the answer can
    # send a one-token match the wrong way), so the target verifies far fewer times than with prompt lookup
    assert warm.tokens == cold.tokens == first
    assert warm.stats.acceptance_rate > 0.8
    assert warm.stats.target_passes <= 12 < cold.stats.target_passes


def test_evicted_answers_leave_the_index_once_as_many_have_gone_as_it_holds():
    index = SuffixIndex(max_sequences=3)
    for i in range(9):  # 6 evicted: two sweeps
        index.add(f"r{i}", [1000 + i, 2000 + i, 3000 + i])
    assert len(index) == 3
    assert index.occurrences((1000,)) == [] and index.occurrences((1008,)) == [((1008, 2008, 3008), 1)]
    # only the live answers' n-grams are keyed: 3 answers x (2 one-grams + 1 two-gram)
    assert len(index._positions) == 3 * 3
    assert SuffixProposer(index).lookup([5, 1007], 2) == [2007, 3007]
