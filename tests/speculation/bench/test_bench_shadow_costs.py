"""speculation.bench.shadow_costs: both engines timed, the report's shape and its ratios (tiny models)."""

from __future__ import annotations

import pytest

from speculation.bench.shadow_costs import SIZES, measure


def test_it_times_the_batch_row_and_the_batch_1_engine_and_reports_their_ratios(tiny_model_dir):
    result = measure(tiny_model_dir, tiny_model_dir, [1, 5, 9, 14, 20, 31, 7, 42], rounds=1)
    for engine in ("single", "batch"):
        assert set(result[engine]["verify_ms"]) == set(SIZES) and result[engine]["draft_step_ms"] > 0
    ratios = result["batch_over_single"]
    assert set(ratios) == {f"verify_{n}" for n in SIZES} | {"draft_step"} and all(r > 0 for r in ratios.values())
    verify_4 = result["batch"]["verify_ms"][4] / result["single"]["verify_ms"][4]
    # the report's ratio is of the unrounded timings, the test's of the reported (rounded to 1 us) ones: a tiny
    # model's verify takes a fraction of a millisecond, so the two may differ in the last digit (1.056 vs 1.057)
    assert ratios["verify_4"] == pytest.approx(verify_4, rel=0.01)
