"""`python -m speculation.bench.sampled_replay`'s rows: sampled runs of each mechanism against shadow's prediction on
their own outputs (the figures in docs/BENCHMARKS.md rest on these)."""

from __future__ import annotations

import pytest

from speculation.bench.sampled_replay import MECHANISMS, run
from speculation.engine import GenerationConfig, LocalTarget, SuffixIndex, generate_plain
from tests.support.models import draft_of, tiny_model

PROMPTS = [[1, 2, 3], [5, 6, 7, 8], [9, 4, 4, 2, 30], [11, 12], [5, 9, 5, 9, 5]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=0)
    return target, draft_of(target)


def test_lookups_are_predicted_exactly_and_the_drafts_close_to_their_runs(pair):
    target, draft = pair
    store = SuffixIndex()
    for i in (0, 2):
        store.add(f"earlier{i}", generate_plain(LocalTarget(target), PROMPTS[i], GenerationConfig(24)).tokens)
    rows = {mechanism: run(target, draft, store, PROMPTS, mechanism, 24) for mechanism in MECHANISMS}
    for mechanism in ("ngram", "suffix"):  # a lookup's replay against the sampled output is the run's own count
        assert rows[mechanism]["predicted_over_measured"] == 1.0
        assert rows[mechanism]["mean_abs_error_per_request"] == 0.0
    for mechanism in ("draft", "hybrid"):  # an expectation: near the runs (5 requests: 25 % is a loose bound)
        row = rows[mechanism]
        assert row["tokens"] == 5 * 24 and row["measured_tokens_per_pass"] > 1.0
        assert row["predicted_over_measured"] == pytest.approx(1.0, abs=0.25)
    assert "iid_tokens_per_pass" in rows["draft"] and "iid_tokens_per_pass" not in rows["hybrid"]


def test_an_eagle_heads_chain_is_predicted_close_to_its_runs(pair, tmp_path):
    from tests.support.eagle import head_for, trained_head

    target, draft = pair
    head = trained_head(target, head_for(target), tmp_path)
    row = run(target, draft, SuffixIndex(), PROMPTS, "eagle", 24, head=head)
    assert row["tokens"] == 5 * 24 and row["measured_tokens_per_pass"] > 1.0  # the head's drafts passed
    assert row["predicted_over_measured"] == pytest.approx(1.0, abs=0.25)  # an expectation over 5 requests
