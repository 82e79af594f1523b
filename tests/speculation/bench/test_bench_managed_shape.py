"""bench_gateway --managed: the report's shape, computed from the measured figures."""

from __future__ import annotations

import pytest

from speculation.bench.managed import shape


def _mode(tok_s: float) -> dict:
    return {
        c: {"tok_s": tok_s * int(c), "p50_ms": 100.0 * int(c), "p99_ms": 200.0 * int(c), "token_ids": [[1, 2], [3]]}
        for c in ("1", "8", "32")
    }


def test_the_report_has_the_issue_shape_with_multipliers_over_off_at_the_same_concurrency():
    switches = [
        {"switch_s": 30.5, "failed_requests": 0},
        {"switch_s": 41.0, "failed_requests": 2},
    ]
    report = shape({"off": _mode(2.0), "ngram": _mode(3.0), "draft_model": _mode(1.0)}, switches, first_start_s=9)

    assert set(report["managed"]) == {"1", "8", "32"}
    row = report["managed"]["8"]
    assert (row["off_tok_s"], row["prod_tok_s"]) == (16.0, 8.0)
    assert row["multiplier"] == pytest.approx(0.5)
    assert (row["p50_ms"], row["p99_ms"]) == (800.0, 1600.0)
    assert report["managed_ngram"]["32"]["multiplier"] == pytest.approx(1.5)
    assert report["switch_s"] == 41.0  # the slowest switch
    assert report["failed_requests"] == 2  # every switch's failures counted
    assert report["first_start_s"] == 9
    assert row["greedy_identical"] == "2 of 2"


def test_greedy_outputs_differing_from_off_are_counted():
    prod = _mode(1.0)
    prod["1"]["token_ids"] = [[1, 2], [4]]
    report = shape(
        {"off": _mode(1.0), "ngram": _mode(1.0), "draft_model": prod}, [{"switch_s": 1, "failed_requests": 0}]
    )
    assert report["managed"]["1"]["greedy_identical"] == "1 of 2"
    assert report["managed_ngram"]["1"]["greedy_identical"] == "2 of 2"


def test_a_zero_off_rate_gives_no_multiplier_rather_than_a_division_error():
    off = {c: {"tok_s": 0.0, "p50_ms": 1.0, "p99_ms": 1.0, "token_ids": [[1, 2], [3]]} for c in ("1", "8", "32")}
    report = shape(
        {"off": off, "ngram": _mode(1.0), "draft_model": _mode(1.0)}, [{"switch_s": 1, "failed_requests": 0}]
    )
    assert report["managed"]["1"]["multiplier"] is None
