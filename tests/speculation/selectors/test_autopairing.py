"""Auto-pairing's table: per workload x candidate the best K by mean projected multiplier, a 95 % interval from
the request count, and a recommendation only with enough evidence."""

from __future__ import annotations

import math

import pytest

from fleet.models import Endpoint
from speculation.models import CandidateMeasurement, DraftKind, DraftModel
from speculation.selectors.autopairing import MIN_REQUESTS, Z, pairing_table

pytestmark = pytest.mark.django_db


def _curve(peak_k: int, peak: float) -> list[float]:
    """A multiplier per K = 1..8 that rises to `peak` at `peak_k` and falls after it."""
    return [round(peak - 0.1 * abs(k - peak_k), 4) for k in range(1, 9)]


def add(endpoint, workload: str, candidate: str, curves: list[list[float]], *, draft=None, status="measured"):
    kind = DraftKind.DRAFT_MODEL if draft else DraftKind.NGRAM
    CandidateMeasurement.objects.bulk_create(
        CandidateMeasurement(
            endpoint=endpoint,
            request_id=f"{workload}-{candidate}-{i}",
            workload=workload,
            candidate=candidate,
            kind=kind,
            draft=draft,
            status=status,
            multiplier=curve if status == "measured" else [],
            mean_accepted_len=[2.0] * 8 if status == "measured" else [],
            counts=[[k, k // 2, 4] for k in range(1, 9)] if status == "measured" else [],
        )
        for i, curve in enumerate(curves)
    )


@pytest.fixture
def endpoint():
    return Endpoint.objects.create(name="pairs", base_url="http://127.0.0.1:9/")


@pytest.fixture
def draft():
    return DraftModel.objects.create(name="small", kind=DraftKind.DRAFT_MODEL, path="/x", tokenizer_fingerprint="f")


def test_a_mixed_stream_ends_with_a_different_winner_per_workload(endpoint, draft):
    # given: code favours n-gram at K = 6, English favours the draft at K = 3 (each request one draw)
    add(endpoint, "code", "ngram", [_curve(6, 2.0 + d) for d in (-0.05, 0.0, 0.05, 0.0, 0.02, -0.02)])
    add(endpoint, "code", "small", [_curve(3, 1.3 + d) for d in (-0.05, 0.0, 0.05, 0.0, 0.02, -0.02)], draft=draft)
    add(endpoint, "english", "ngram", [_curve(2, 1.05 + d) for d in (-0.02, 0.0, 0.02, 0.0, 0.01)])
    add(endpoint, "english", "small", [_curve(3, 1.6 + d) for d in (-0.02, 0.0, 0.02, 0.0, 0.01)], draft=draft)
    add(endpoint, "english", "small", [[]] * 3, draft=draft, status="shed")

    table = pairing_table(endpoint_id=endpoint.pk)

    code, english = table["workloads"]["code"], table["workloads"]["english"]
    assert list(table["workloads"]) == ["code", "english"]  # most measured requests first
    assert (code["recommendation"].candidate, code["recommendation"].k) == ("ngram", 6)
    assert (english["recommendation"].candidate, english["recommendation"].k) == ("small", 3)
    assert code["recommendation"].confident and english["recommendation"].confident
    small = next(c for c in english["cells"] if c.candidate == "small")
    assert (small.requests, small.shed) == (5, 3)
    assert small.acceptance_rate == pytest.approx(1 / 3, abs=1e-4)  # accepted 1 of 3 drafted at K = 3
    # overall pools both workloads: 6 + 5 requests per candidate
    overall = table["overall"]["recommendation"]
    assert overall.requests == 11


def test_the_interval_is_the_normal_one_from_the_request_count(endpoint):
    draws = [1.0, 1.2, 1.4, 1.6, 1.8]
    add(endpoint, "code", "ngram", [[d] * 8 for d in draws])

    (cell,) = pairing_table(endpoint_id=endpoint.pk)["workloads"]["code"]["cells"]

    mean = sum(draws) / len(draws)
    half = Z * math.sqrt(sum((d - mean) ** 2 for d in draws) / (len(draws) - 1)) / math.sqrt(len(draws))
    assert cell.best_k == 1  # a tie over K: the smallest
    assert (cell.multiplier, cell.ci_low, cell.ci_high) == pytest.approx((mean, mean - half, mean + half), abs=1e-4)


def test_too_few_requests_or_overlapping_intervals_are_not_a_confident_recommendation(endpoint, draft):
    add(endpoint, "rare", "ngram", [_curve(4, 2.0)] * (MIN_REQUESTS - 1))
    add(endpoint, "close", "ngram", [_curve(4, 1.50 + d) for d in (-0.3, 0.3, -0.3, 0.3, 0.0)])
    add(endpoint, "close", "small", [_curve(4, 1.45 + d) for d in (-0.3, 0.3, -0.3, 0.3, 0.0)], draft=draft)

    table = pairing_table(endpoint_id=endpoint.pk)

    assert table["workloads"]["rare"]["recommendation"] is None
    close = table["workloads"]["close"]["recommendation"]
    assert close.candidate == "ngram" and not close.confident and close.runner_up == "small"
