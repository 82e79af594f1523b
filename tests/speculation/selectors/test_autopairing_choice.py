"""The per-request rule of `draft: auto` in prod (workload_choice) and prod's own rows in the table: a winner needs
PROD_MIN_REQUESTS requests and must clear the fallback (the pooled winner, else the policy's draft), paired over the
requests both were replayed on; a row for one K counts at that K only."""

from __future__ import annotations

import pytest

from fleet.models import Endpoint
from speculation.models import CandidateMeasurement, DraftKind, DraftModel
from speculation.selectors.autopairing import PROD_MIN_REQUESTS, Choice, pairing_table, workload_choice

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


def test_the_winner_runs_at_its_best_k_once_it_has_enough_requests(endpoint):
    add(endpoint, "code", "fast", peak_k=6, peak=2.0, n=PROD_MIN_REQUESTS)
    add(endpoint, "code", "own", peak_k=3, peak=1.4, n=PROD_MIN_REQUESTS)
    choice = workload_choice(pairing_table(endpoint_id=endpoint.pk), workload="code", current=policy())
    assert (choice.candidate, choice.k, choice.from_evidence) == ("fast", 6, True)
    assert choice.reason.startswith(f"auto: code -> fast K=6, {PROD_MIN_REQUESTS} requests, projected 2.00x [")


def test_one_request_short_of_the_minimum_keeps_the_policys_draft_and_k(endpoint):
    add(endpoint, "code", "fast", peak_k=6, peak=2.0, n=PROD_MIN_REQUESTS - 1)
    choice = workload_choice(pairing_table(endpoint_id=endpoint.pk), workload="code", current=policy())
    assert (choice.candidate, choice.k, choice.from_evidence) == ("own", 5, False)
    assert "9 measured requests (needs 10)" in choice.reason


def test_a_winner_whose_interval_reaches_the_policys_draft_leaves_the_policys_draft_at_its_best_k(endpoint):
    # given: `fast` leads by 0.02x with draws +-0.3: its interval covers `own`'s mean
    add(endpoint, "code", "fast", peak_k=6, peak=1.52, n=PROD_MIN_REQUESTS, spread=0.3)
    add(endpoint, "code", "own", peak_k=4, peak=1.5, n=PROD_MIN_REQUESTS)
    choice = workload_choice(pairing_table(endpoint_id=endpoint.pk), workload="code", current=policy())
    assert (choice.candidate, choice.k) == ("own", 4)
    assert "fast at 1.52x is not clearly better" in choice.reason


@pytest.mark.parametrize("shared", [True, False])
def test_a_small_lead_on_the_same_requests_is_resolved_by_pairing_them(endpoint, shared):
    # given: requests alternate easy / hard (+-0.3, shared by both candidates); `fast` leads by 0.1x on each one
    add(endpoint, "code", "fast", peak_k=6, peak=1.6, n=PROD_MIN_REQUESTS, spread=0.3, shared=shared)
    add(endpoint, "code", "own", peak_k=4, peak=1.5, n=PROD_MIN_REQUESTS, spread=0.3, shared=shared)
    table = pairing_table(endpoint_id=endpoint.pk)
    best, own = sorted(table["workloads"]["code"]["cells"], key=lambda c: c.candidate)
    assert best.ci_low < own.multiplier  # the unpaired intervals overlap

    choice = workload_choice(table, workload="code", current=policy())

    # then: paired, every difference is +0.1: `fast` is clearly better; unpaired (other requests) it is not
    assert (choice.candidate, choice.k) == (("fast", 6) if shared else ("own", 4))


def test_a_workload_short_of_evidence_runs_the_pooled_winner_when_that_is_clear(endpoint):
    # given: `fast` clearly above the policy's `own` over code's requests; qa has 3 requests
    add(endpoint, "code", "fast", peak_k=6, peak=2.0, n=PROD_MIN_REQUESTS, shared=True)
    add(endpoint, "code", "own", peak_k=3, peak=1.4, n=PROD_MIN_REQUESTS, shared=True)
    add(endpoint, "qa", "own", peak_k=3, peak=1.4, n=3, shared=True)

    choice = workload_choice(pairing_table(endpoint_id=endpoint.pk), workload="qa", current=policy())

    assert (choice.candidate, choice.k, choice.from_evidence) == ("fast", 6, True)
    assert choice.reason.startswith(
        f"auto: qa has 3 measured requests (needs {PROD_MIN_REQUESTS}): the endpoint's pooled choice: "
        f"every workload -> fast K=6, {PROD_MIN_REQUESTS} requests"
    ), choice.reason


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
    assert cell.best_k == 3
    assert cell.multiplier == pytest.approx((1.5 * 4 + 2.5) / 5)
    assert cell.mean_accepted_len == pytest.approx((2.0 * 4 + 3.0) / 5)
    assert cell.per_k_multiplier[3] == pytest.approx(1.4)  # K = 4: the shadow rows alone
    assert cell.acceptance_rate == pytest.approx((4 * 1 + 6) / (4 * 3 + 9), abs=1e-4)  # rounded to 4 places
