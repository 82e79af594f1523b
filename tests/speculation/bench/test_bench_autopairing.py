"""bench_autopairing's arithmetic: online auto-pairing learns per workload from earlier requests only, and the
report compares it with the best single candidate and the per-workload oracle on the same requests."""

from __future__ import annotations

import pytest

from speculation.bench.autopairing import MIN_EVIDENCE, Measured, report, simulate

KEYS = [("ngram", 4), ("draft", 4)]


def request(workload: str, ngram: float, draft: float) -> Measured:
    values = {("ngram", 4): ngram, ("draft", 4): draft}
    return Measured(workload=workload, multiplier=values, tokens_per_step={key: 2 * v for key, v in values.items()})


def test_auto_pairing_learns_a_different_winner_per_workload_from_earlier_requests_only():
    # given: code favours n-gram (2.0 vs 1.2), english the draft (1.5 vs 1.0), alternating
    stream = [request("code", 2.0, 1.2) if i % 2 else request("english", 1.0, 1.5) for i in range(40)]

    chosen = simulate(stream, first=("draft", 4))

    # then: once a workload has MIN_EVIDENCE requests its own winner is used
    late = {stream[i].workload: chosen[i] for i in range(2 * MIN_EVIDENCE + 2, 40)}
    assert late == {"code": ("ngram", 4), "english": ("draft", 4)}
    result = report(stream, chosen)
    assert result["best_single"] == "ngram@K4"  # 20 * 2.0 + 20 * 1.0 > 20 * 1.2 + 20 * 1.5
    assert result["workloads"]["english"]["oracle"] == "draft@K4"
    assert result["overall_gain"] > 1.0 and 0.0 <= result["regret"] < 0.1
    english = result["workloads"]["english"]
    assert english["best_single_projected"] == pytest.approx(1.0) and english["oracle_projected"] == pytest.approx(1.5)


def test_the_first_request_uses_the_given_default_and_then_the_overall_best():
    stream = [request("a", 1.0, 3.0), request("b", 1.0, 3.0)]
    assert simulate(stream, first=("ngram", 4)) == [("ngram", 4), ("draft", 4)]
