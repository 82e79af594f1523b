"""The projection formula reproduces the ANCHORS section 1 table and picks the best K."""

from __future__ import annotations

import pytest

from speculation.engine.projection import expected_tokens, multiplier, project


@pytest.mark.parametrize(
    ("alpha", "e_n", "s_002", "s_005", "s_01", "s_02"),
    [
        (0.5, 1.97, 1.79, 1.57, 1.31, 0.98),
        (0.7, 2.94, 2.67, 2.35, 1.96, 1.47),
        (0.9, 4.69, 4.26, 3.75, 3.12, 2.34),
    ],
)
def test_k5_matches_the_anchor_table_to_two_decimals(alpha, e_n, s_002, s_005, s_01, s_02):
    assert round(expected_tokens(alpha=alpha, k=5), 2) == e_n
    for c, s in ((0.02, s_002), (0.05, s_005), (0.1, s_01), (0.2, s_02)):
        assert round(multiplier(alpha=alpha, k=5, c=c), 2) == s


@pytest.mark.parametrize(("c", "best_k"), [(0.05, 6), (0.2, 3)])
def test_best_k_depends_on_draft_cost(c, best_k):
    points = project(alpha=0.7, c=c)
    assert [p.k for p in points] == list(range(1, 9))
    assert [p.k for p in points if p.best] == [best_k]


def test_perfect_draft_gives_k_plus_one_tokens_and_verification_cost_divides():
    assert expected_tokens(alpha=1.0, k=4) == 5.0
    assert multiplier(alpha=1.0, k=4, c=0.0, v=2.0) == 2.5


def test_out_of_range_inputs_are_refused():
    with pytest.raises(ValueError):
        expected_tokens(alpha=1.5, k=3)
    with pytest.raises(ValueError):
        multiplier(alpha=0.5, k=3, c=-0.1)
