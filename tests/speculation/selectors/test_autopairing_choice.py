"""The per-request rule of `draft: auto` in prod (workload_choice) and prod's own rows in the table: after
PROD_MIN_REQUESTS pooled requests, the (candidate, K) with the highest mean for the workload shrunk toward the pooled
mean by PRIOR_REQUESTS; a row for one K counts at that K only."""

from __future__ import annotations

import pytest

from fleet.models import Endpoint
from speculation.models import CandidateMeasurement, DraftKind, DraftModel
from speculation.selectors.autopairing import (
    PRIOR_REQUESTS,
    PROD_MIN_REQUESTS,
    Choice,
    pairing_table,
    workload_choice,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def endpoint():
    return Endpoint.objects.create(name="choice", base_url="http://127.0.0.1:9/")


def add(endpoint, workload, candidate, *, peak_k, peak, n, kind=DraftKind.DRAFT_MODEL, spread=0.02, shared=False):
    """n requests of one candidate; `shared`: the same request ids as the other candidates' (shadow replays every
    candidate on each request), else ids of its own (nothing to pair)."""
    draft = None
    if kind != DraftKind.NGRAM:
        draft, _ = DraftModel.objects.get_or_create(name=candidate, defaults={"kind": kind, "path": "/x"})
    CandidateMeasurement.objects.bulk_create(
        CandidateMeasurement(
            endpoint=endpoint, request_id=f"{workload}-{i}" if shared else f"{workload}-{candidate}-{i}",
            workload=workload, candidate=candidate, kind=kind, draft=draft,
            multiplier=[round(peak + (spread if i % 2 else -spread) - 0.1 * abs(k - peak_k), 4) for k in range(1, 9)],
            mean_accepted_len=[2.0] * 8, counts=[[k, 1, 3] for k in range(1, 9)],
        )
        for i in range(n)
    )  # fmt: skip
    return draft


def policy(name="own", kind=DraftKind.DRAFT_MODEL, k=5) -> Choice:
    return Choice(name, kind, None, k, "", from_evidence=False)


def test_the_workloads_winner_runs_at_its_best_k(endpoint):
    add(endpoint, "code", "fast", peak_k=6, peak=2.0, n=10)
    add(endpoint, "code", "own", peak_k=3, peak=1.4, n=10)
    choice = workload_choice(pairing_table(endpoint_id=endpoint.pk), workload="code", current=policy())
    assert (choice.candidate, choice.k, choice.from_evidence) == ("fast", 6, True)
    assert (
        choice.reason
        == "auto: code -> fast K=6, projected 2.00x (10 code requests at 2.00x; 10 requests pooled at 2.00x)"
    )


def test_until_the_minimum_is_pooled_the_policys_draft_and_k_run(endpoint):
    add(endpoint, "code", "fast", peak_k=6, peak=2.0, n=PROD_MIN_REQUESTS - 1)
    choice = workload_choice(pairing_table(endpoint_id=endpoint.pk), workload="code", current=policy())
    assert (choice.candidate, choice.k, choice.from_evidence) == ("own", 5, False)
    assert choice.reason == (
        f"auto: {PROD_MIN_REQUESTS - 1} measured requests (needs {PROD_MIN_REQUESTS}): the policy's own K=5"
    )


def shrunk(own_sum: float, own_n: int, pooled: float) -> float:
    return (own_sum + PRIOR_REQUESTS * pooled) / (own_n + PRIOR_REQUESTS)


def test_a_workloads_own_evidence_is_shrunk_toward_the_pooled_mean_by_its_amount(endpoint):
    # given: english (20 requests) favours `prose` at K = 2 (1.8 vs 1.2); code has 1 request where `code` leads
    add(endpoint, "english", "prose", peak_k=2, peak=1.8, n=20, shared=True, spread=0.0)
    add(endpoint, "english", "code", peak_k=6, peak=1.2, n=20, shared=True, spread=0.0)
    add(endpoint, "code", "prose", peak_k=2, peak=1.6, n=1, shared=True, spread=0.0)
    add(endpoint, "code", "code", peak_k=6, peak=2.2, n=1, shared=True, spread=0.0)
    table = pairing_table(endpoint_id=endpoint.pk)

    # when / then: code's one request weighs 1 against the pooled mean's PRIOR_REQUESTS
    one = workload_choice(table, workload="code", current=policy())
    prose_est = shrunk(1.6, 1, (20 * 1.8 + 1.6) / 21)
    code_est = shrunk(2.2, 1, (20 * 1.2 + 2.2) / 21)
    assert prose_est > code_est
    assert (one.candidate, one.k) == ("prose", 2)
    assert one.reason.startswith(f"auto: code -> prose K=2, projected {prose_est:.2f}x (1 code requests at 1.60x;")

    # given: 9 more code requests alike; then code's own winner outweighs the pooled mean
    add(endpoint, "code", "prose", peak_k=2, peak=1.6, n=9, shared=True, spread=0.0)
    add(endpoint, "code", "code", peak_k=6, peak=2.2, n=9, shared=True, spread=0.0)
    ten = workload_choice(pairing_table(endpoint_id=endpoint.pk), workload="code", current=policy())
    assert (ten.candidate, ten.k) == ("code", 6)
    assert ten.reason.startswith(f"auto: code -> code K=6, projected {shrunk(22.0, 10, (24 + 22) / 30):.2f}x")


def test_a_workload_without_evidence_runs_the_pooled_winner(endpoint):
    add(endpoint, "code", "fast", peak_k=6, peak=2.0, n=10, shared=True)
    add(endpoint, "code", "own", peak_k=3, peak=1.4, n=10, shared=True)

    choice = workload_choice(pairing_table(endpoint_id=endpoint.pk), workload="qa", current=policy())

    assert (choice.candidate, choice.k, choice.from_evidence) == ("fast", 6, True)
    assert choice.reason == "auto: qa -> fast K=6, projected 2.00x (no qa requests yet; 10 requests pooled at 2.00x)"


def test_a_tie_goes_to_the_smaller_k_then_the_policys_candidate(endpoint):
    add(endpoint, "code", "own", peak_k=4, peak=1.5, n=4, spread=0.0)
    add(endpoint, "code", "other", peak_k=4, peak=1.5, n=4, spread=0.0)
    CandidateMeasurement.objects.filter(candidate="own").update(multiplier=[1.5] * 8)
    CandidateMeasurement.objects.filter(candidate="other").update(multiplier=[1.0, 1.5] + [1.0] * 6)
    choice = workload_choice(pairing_table(endpoint_id=endpoint.pk), workload="code", current=policy())
    assert (choice.candidate, choice.k) == ("own", 1)
    CandidateMeasurement.objects.filter(candidate="own").update(multiplier=[1.0, 1.5] + [1.0] * 6)
    choice = workload_choice(pairing_table(endpoint_id=endpoint.pk), workload="code", current=policy())
    assert (choice.candidate, choice.k) == ("own", 2)


def test_the_remote_path_never_gets_an_eagle_head(endpoint):
    add(endpoint, "code", "head", peak_k=5, peak=3.0, n=PROD_MIN_REQUESTS, kind=DraftKind.EAGLE_HEAD)
    add(endpoint, "code", "ngram", peak_k=3, peak=1.6, n=PROD_MIN_REQUESTS, kind=DraftKind.NGRAM)
    table = pairing_table(endpoint_id=endpoint.pk)
    remote = frozenset({DraftKind.NGRAM, DraftKind.DRAFT_MODEL})
    assert workload_choice(table, workload="code", current=policy(), kinds=remote).candidate == "ngram"
    assert workload_choice(table, workload="code", current=policy()).candidate == "head"


def test_a_prod_row_counts_at_the_k_it_ran_only(endpoint):
    add(endpoint, "code", "own", peak_k=3, peak=1.5, n=4)
    CandidateMeasurement.objects.create(
        endpoint=endpoint, request_id="prod-1", workload="code", candidate="own", kind=DraftKind.DRAFT_MODEL,
        multiplier=[None, None, 2.5, None, None, None, None, None],
        mean_accepted_len=[None, None, 3.0, None, None, None, None, None],
        counts=[[], [], [9, 6, 4], [], [], [], [], []],
    )  # fmt: skip
    (cell,) = pairing_table(endpoint_id=endpoint.pk)["workloads"]["code"]["cells"]
    assert cell.requests == 5
    assert cell.per_k_requests == [4, 4, 5, 4, 4, 4, 4, 4]
    assert cell.best_k == 3
    assert cell.multiplier == pytest.approx((1.5 * 4 + 2.5) / 5)
    assert cell.mean_accepted_len == pytest.approx((2.0 * 4 + 3.0) / 5)
    assert cell.per_k_multiplier[3] == pytest.approx(1.4)  # K = 4: the shadow rows alone
    assert cell.acceptance_rate == pytest.approx((4 * 1 + 6) / (4 * 3 + 9), abs=1e-4)  # rounded to 4 places
