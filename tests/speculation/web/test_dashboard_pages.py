"""Dashboard pages: login, empty states, the mode toggle and settings form through the policy service,
reasons for unavailable options, chart data and the records table, the REST timeseries."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from fleet.models import Endpoint, EndpointStatus
from fleet.permissions import ADMIN, grant_role
from speculation.models import Action, DraftKind, DraftModel, Mode, PolicyChange, SpeculationPolicy, StageRecord

pytestmark = pytest.mark.django_db

FP = "f" * 64


@pytest.fixture
def user():
    # An admin: the dashboard tests are about the pages, not ownership (roles: tests/fleet/test_roles.py).
    user = get_user_model().objects.create_user("ops", password="pw-for-tests-only")
    grant_role(user=user, role=ADMIN)
    return user


@pytest.fixture
def client_in(client, user):
    client.force_login(user)
    return client


@pytest.fixture
def endpoint() -> Endpoint:
    return Endpoint.objects.create(
        name="llama",
        base_url="http://127.0.0.1:9/",
        status=EndpointStatus.READY,
        capabilities={
            "tokenizer_fingerprint": FP,
            "token_id_prompts": True,
            "prompt_scoring_method": "prompt_logprobs",
            "tpot_ms": 20.0,
        },
    )


def add_records(endpoint: Endpoint, n: int, *, mode: str = Mode.SHADOW, minutes_ago: int = 5, **fields) -> None:
    action = Action.WOULD_SPECULATE if mode == Mode.SHADOW else Action.SPECULATED
    defaults = {"drafted_tokens": 10, "accepted_tokens": 7, "k": 5, "alpha": 0.7, "multiplier": 1.8}
    StageRecord.objects.bulk_create(
        [
            StageRecord(endpoint=endpoint, request_id=f"{mode}-{i}", mode=mode, action=action, **(defaults | fields))
            for i in range(n)
        ]
    )
    StageRecord.objects.filter(endpoint=endpoint, mode=mode).update(
        created_at=timezone.now() - timedelta(minutes=minutes_ago)
    )


def test_pages_need_login(client, endpoint):
    for url in (
        reverse("speculation:overview"),
        reverse("speculation:endpoint", args=[endpoint.pk]),
        reverse("speculation:projection", args=[endpoint.pk]),
        reverse("speculation:draft-list"),
    ):
        response = client.get(url)
        assert response.status_code == 302 and "/login/" in response["Location"], url
    assert client.get(
        reverse("dashboard-api:endpoint-timeseries", args=[endpoint.pk]) + "?metric=alpha"
    ).status_code in (401, 403)


def test_overview_without_endpoints_says_register_one(client_in):
    body = client_in.get(reverse("speculation:overview")).content.decode()
    assert "No endpoint yet" in body and reverse("fleet:endpoint-create") in body


def test_overview_shows_acceptance_multiplier_and_why_prod_is_unavailable(client_in, endpoint):
    # given: shadow measurements, the default n-gram policy, and an endpoint that cannot go prod yet
    SpeculationPolicy.objects.create(endpoint=endpoint, mode=Mode.SHADOW)
    add_records(endpoint, 4)
    other = Endpoint.objects.create(name="fresh", base_url="http://127.0.0.1:9/", status=EndpointStatus.NEW)

    body = client_in.get(reverse("speculation:overview")).content.decode()

    assert "No stage records in the last day" not in body
    assert "70%" in body  # 7 / 10 accepted
    assert "<i>1.80×</i>" in body  # projected (shadow) multiplier, in italics
    assert f"prod needs a ready endpoint; {other.name} is new" in body
    assert 'id="bars-empty"' in body  # no prod traffic yet


def test_mode_toggle_switches_through_the_policy_service_and_records_who(client_in, endpoint, user):
    response = client_in.post(reverse("speculation:endpoint-mode", args=[endpoint.pk]), {"mode": "shadow"})

    assert response.status_code == 302
    policy = SpeculationPolicy.objects.get(endpoint=endpoint)
    assert policy.mode == Mode.SHADOW
    change = PolicyChange.objects.get(policy=policy)
    # the change also fixes the auto path (resolved when the policy is saved, never by a re-probe)
    assert change.changes["mode"] == ["off", "shadow"] and change.changed_by == user
    assert set(change.changes) <= {"mode", "resolved_path", "path_evidence"}


def test_mode_toggle_refusal_keeps_the_mode_and_says_why(client_in, endpoint):
    endpoint.status = EndpointStatus.UNREACHABLE
    endpoint.save()

    response = client_in.post(reverse("speculation:endpoint-mode", args=[endpoint.pk]), {"mode": "prod"}, follow=True)

    assert "stays as it was: prod needs a ready endpoint" in response.content.decode()
    assert not SpeculationPolicy.objects.filter(endpoint=endpoint, mode=Mode.PROD).exists()


def test_mode_toggle_ignores_an_offsite_next(client_in, endpoint):
    response = client_in.post(
        reverse("speculation:endpoint-mode", args=[endpoint.pk]), {"mode": "shadow", "next": "https://evil.example/"}
    )
    assert response["Location"] == reverse("speculation:overview")


def test_endpoint_page_embeds_chart_data_and_paginates_records(client_in, endpoint):
    SpeculationPolicy.objects.create(endpoint=endpoint, mode=Mode.SHADOW)
    add_records(endpoint, 30, per_position_acceptance=[1.0, 0.5], target_passes=2, accepted_length_hist=[0, 1, 1])

    url = reverse("speculation:endpoint", args=[endpoint.pk])
    response = client_in.get(url)

    assert response.status_code == 200
    charts = response.context["charts"]
    (shadow,) = charts["acceptance_rate"]["series"]
    assert shadow["name"] == "shadow" and shadow["y"] == [0.7] and shadow["n"] == [30]
    assert charts["per_position"]["shadow"][:2] == [1.0, 0.5]
    assert charts["histogram"]["shadow"] == [0, 30, 30]
    body = response.content.decode()
    assert 'id="chart-data"' in body and "vendor/plotly.min.js" in body
    server = client_in.get(url, {"view": "server"}).content.decode()
    assert "capabilit" in server.lower()  # the fleet detail part (probe results) is the server view
    # the records table: the 25 newest, then the 5 older ones by keyset, and back
    records = client_in.get(url, {"view": "records"})
    first, body = records.context["page"], records.content.decode()
    assert len(first.object_list) == 25 and first.newer is None and f"before={first.older}" in body
    older = client_in.get(url, {"view": "records", "before": first.older})
    second = older.context["page"]
    assert len(second.object_list) == 5 and second.older is None
    assert {r.pk for r in first.object_list}.isdisjoint(r.pk for r in second.object_list)
    newer = client_in.get(url, {"view": "records", "after": second.newer})
    assert [r.pk for r in newer.context["page"].object_list] == [r.pk for r in first.object_list]


def test_the_records_table_never_counts_the_records(client_in, endpoint):
    add_records(endpoint, 3)

    with CaptureQueriesContext(connection) as queries:
        response = client_in.get(
            reverse("speculation:endpoint", args=[endpoint.pk]), {"view": "records", "before": "junk"}
        )

    assert response.status_code == 200 and len(response.context["page"].object_list) == 3
    assert not [q["sql"] for q in queries.captured_queries if "COUNT(*)" in q["sql"]]


def test_records_filter_by_action(client_in, endpoint):
    add_records(endpoint, 3)
    StageRecord.objects.create(
        endpoint=endpoint, request_id="skip-1", mode=Mode.PROD, action=Action.SKIPPED, reason="n > 1"
    )

    response = client_in.get(
        reverse("speculation:endpoint", args=[endpoint.pk]), {"view": "records", "action": "skipped"}
    )

    rows = list(response.context["page"].object_list)
    assert [r.request_id for r in rows] == ["skip-1"]
    assert "n &gt; 1" in response.content.decode()


def test_endpoint_page_says_why_a_draft_does_not_fit(client_in, endpoint):
    DraftModel.objects.create(name="other-vocab", kind=DraftKind.DRAFT_MODEL, path="/x", tokenizer_fingerprint="0" * 64)
    DraftModel.objects.create(name="same-vocab", kind=DraftKind.DRAFT_MODEL, path="/y", tokenizer_fingerprint=FP)

    response = client_in.get(reverse("speculation:endpoint", args=[endpoint.pk]), {"view": "settings"})

    options = {o.value: o for o in response.context["draft_options"]}
    assert options["same-vocab"].available
    assert not options["other-vocab"].available and "does not match" in options["other-vocab"].reason
    assert 'data-unavailable-draft="other-vocab"' in response.content.decode()


def test_settings_form_saves_through_the_service(client_in, endpoint):
    DraftModel.objects.create(name="same-vocab", kind=DraftKind.DRAFT_MODEL, path="/y", tokenizer_fingerprint=FP)
    form = {
        "mode": "prod",
        "mechanism": "draft_model",
        "draft": "same-vocab",
        "k": 4,
        "shadow_sample_rate": 0.5,
        "path": "remote",
        "target_path": "",
    }

    response = client_in.post(reverse("speculation:endpoint-policy", args=[endpoint.pk]), form)

    assert response.status_code == 302
    policy = SpeculationPolicy.objects.select_related("draft").get(endpoint=endpoint)
    assert (policy.mode, policy.draft.name, policy.k, policy.path) == ("prod", "same-vocab", 4, "remote")


def test_the_settings_form_sets_suffix_decoding_with_a_draft_fallback_and_the_pages_say_so(client_in, endpoint):
    DraftModel.objects.create(name="same-vocab", kind=DraftKind.DRAFT_MODEL, path="/y", tokenizer_fingerprint=FP)
    form = {"mode": "prod", "mechanism": "suffix_draft", "draft": "same-vocab", "k": 3, "shadow_sample_rate": 1.0,
            "path": "remote", "target_path": ""}  # fmt: skip

    response = client_in.post(reverse("speculation:endpoint-policy", args=[endpoint.pk]), form)

    assert response.status_code == 302
    policy = SpeculationPolicy.objects.select_related("draft").get(endpoint=endpoint)
    assert (policy.mechanism, policy.draft.name, policy.k) == ("suffix_draft", "same-vocab", 3)
    page = client_in.get(reverse("speculation:endpoint", args=[endpoint.pk])).content.decode()
    assert "same-vocab behind suffix decoding" in page
    assert "behind suffix decoding" in client_in.get(reverse("speculation:overview")).content.decode()
    # on the native path (of a server that speculates itself) it is refused on the field, nothing saved
    Endpoint.objects.filter(pk=endpoint.pk).update(capabilities={**endpoint.capabilities, "native_speculation": True})
    response = client_in.post(reverse("speculation:endpoint-policy", args=[endpoint.pk]), {**form, "path": "native"})
    assert response.status_code == 400
    assert "runs in ACE's worker" in " ".join(response.context["form"].errors["path"])
    assert SpeculationPolicy.objects.get(endpoint=endpoint).path == "remote"


def test_settings_form_shows_the_service_refusal_on_the_field(client_in, endpoint):
    DraftModel.objects.create(name="other-vocab", kind=DraftKind.DRAFT_MODEL, path="/x", tokenizer_fingerprint="0" * 64)
    form = {
        "mode": "prod",
        "mechanism": "draft_model",
        "draft": "other-vocab",
        "k": 5,
        "shadow_sample_rate": 1,
        "path": "auto",
    }

    response = client_in.post(reverse("speculation:endpoint-policy", args=[endpoint.pk]), form)

    assert response.status_code == 400
    assert "does not match" in " ".join(response.context["form"].errors["draft"])
    assert not SpeculationPolicy.objects.filter(endpoint=endpoint, mode="prod").exists()


def add_calibration(endpoint: Endpoint, *, target_ms: float, draft_ms: float, verify_ms: dict[int, float]) -> None:
    """The step costs a GPU worker measured (speculation.worker.costs)."""
    from speculation.models import CostCalibration

    CostCalibration.objects.create(
        endpoint=endpoint,
        node_class="cpu",
        path="remote",
        target_step_ms=target_ms,
        draft_step_ms=draft_ms,
        verify_ms={str(n): ms for n, ms in verify_ms.items()},
        repeats=5,
    )


def test_projection_marks_the_best_k_from_measured_alpha_and_costs(client_in, endpoint):
    SpeculationPolicy.objects.create(endpoint=endpoint, mode=Mode.SHADOW)
    add_records(endpoint, 5, alpha=0.7, mean_accepted_len=3.0, multiplier=1.5, target_passes=2, output_tokens=6)
    # the worker measured a draft step of 2 ms on a 10 ms target step (c = 0.2), verification as one step (v = 1)
    add_calibration(endpoint, target_ms=10.0, draft_ms=2.0, verify_ms={1: 10.0, 9: 10.0})

    response = client_in.get(reverse("speculation:projection", args=[endpoint.pk]))
    what_if = client_in.get(reverse("speculation:projection", args=[endpoint.pk]), {"c": "0.05"})

    assert response.context["costs"]["c"] == 0.2 and response.context["assumed"] is False
    curve = response.context["curve"]
    assert [p.k for p in curve] == list(range(1, 9))
    assert response.context["best"].k == 3  # ANCHORS: alpha 0.7, c 0.2 -> K* = 3
    assert 'id="best-k">3<' in response.content.decode()
    assert what_if.context["best"].k == 6 and what_if.context["assumed"] is True  # alpha 0.7, c 0.05 -> K* = 6


def test_projection_divides_by_the_verify_cost_measured_per_k(client_in, endpoint):
    SpeculationPolicy.objects.create(endpoint=endpoint, mode=Mode.SHADOW, k=5)
    add_records(endpoint, 3, alpha=0.7, mean_accepted_len=3.0, multiplier=1.5, target_passes=2, output_tokens=6)
    # verifying 2 tokens costs one step, 9 tokens three steps: longer lookaheads pay less than with v = 1
    add_calibration(endpoint, target_ms=10.0, draft_ms=0.5, verify_ms={1: 10.0, 2: 10.0, 9: 30.0})

    response = client_in.get(reverse("speculation:projection", args=[endpoint.pk]))
    api = client_in.get(f"/api/v1/endpoints/{endpoint.pk}/projection/").json()

    v_at_5 = (10.0 + (6 - 2) / (9 - 2) * 20.0) / 10.0  # 6 tokens verified: interpolated between 2 and 9
    assert response.context["v"] == pytest.approx(v_at_5, abs=1e-4)
    s_at_5 = next(p.multiplier for p in response.context["curve"] if p.k == 5)
    assert s_at_5 == pytest.approx((1 - 0.7**6) / 0.3 / (v_at_5 + 5 * 0.05))
    assert response.context["best"].k < 5  # with v = 1 it would be 7 (alpha 0.7, c 0.05)
    assert api["v"] == response.context["v"] and api["assumed"] is False
    assert [p["k"] for p in api["curve"] if p["best"]] == [response.context["best"].k]


def test_endpoint_page_shows_shadows_projection_beside_prods_measurement_per_k(client_in, endpoint):
    SpeculationPolicy.objects.create(endpoint=endpoint, mode=Mode.PROD, k=3)
    add_records(endpoint, 4, k=3, multiplier=2.0, mean_accepted_len=3.0, target_passes=2)  # shadow projected 2.0x
    add_records(endpoint, 2, mode=Mode.PROD, k=3, multiplier=2.5, mean_accepted_len=3.0, target_passes=2)
    add_records(endpoint, 1, mode=Mode.PROD, k=5, multiplier=1.5)  # prod only at K = 5
    add_calibration(endpoint, target_ms=10.0, draft_ms=1.0, verify_ms={1: 10.0, 9: 10.0})

    response = client_in.get(reverse("speculation:endpoint", args=[endpoint.pk]), {"view": "autopairing"})

    rows = {row["k"]: row for row in response.context["projection_rows"]}
    assert rows[3]["shadow"] == {"n": 4, "multiplier": 2.0} and rows[3]["prod"] == {"n": 2, "multiplier": 2.5}
    assert rows[3]["ratio"] == 0.8
    assert rows[5]["shadow"] is None and rows[5]["prod"]["multiplier"] == 1.5 and rows[5]["ratio"] is None
    assert rows[3]["v"] == 1.0 and rows[3]["curve"] is not None  # the curve from alpha 0.7 with c = 0.1, v = 1
    body = response.content.decode()
    assert 'id="projection-vs-prod-table"' in body and "the server's plain decode step" in body
    assert "2.00×" in body and "2.50×" in body


def test_endpoint_page_says_when_no_costs_are_measured_yet(client_in, endpoint):
    body = client_in.get(reverse("speculation:endpoint", args=[endpoint.pk]), {"view": "autopairing"}).content.decode()
    assert "no calibration yet" in body and 'id="projection-vs-prod-empty"' in body


def test_projection_without_shadow_data_says_what_to_do(client_in, endpoint):
    body = client_in.get(reverse("speculation:projection", args=[endpoint.pk])).content.decode()
    assert "No shadow measurements" in body and "<b>shadow</b>" in body


def test_drafts_page_shows_compatibility_per_endpoint(client_in, endpoint):
    DraftModel.objects.create(name="other-vocab", kind=DraftKind.DRAFT_MODEL, path="/x", tokenizer_fingerprint="0" * 64)
    DraftModel.objects.create(name="lookup", kind=DraftKind.NGRAM)

    response = client_in.get(reverse("speculation:draft-list"))

    cells = {row["draft"].name: row["cells"][0][1] for row in response.context["matrix"]}
    assert cells == {"lookup": True, "other-vocab": False}


def test_registering_a_draft_from_a_missing_path_says_why(client_in):
    response = client_in.post(
        reverse("speculation:draft-list"),
        {"name": "d1", "kind": "draft_model", "path": "/nowhere", "node_class": "cpu"},
    )
    assert response.status_code == 400
    # outside ACE_MODEL_ROOTS: one message whether or not the path exists (tests/speculation/test_model_files.py)
    assert "must lie under the model roots" in " ".join(response.context["form"].errors["path"])


def test_registering_an_ngram_draft(client_in):
    response = client_in.post(
        reverse("speculation:draft-list"), {"name": "lookup", "kind": "ngram", "node_class": "cpu"}
    )
    assert response.status_code == 302
    assert DraftModel.objects.filter(name="lookup", kind="ngram").exists()


def test_timeseries_api_matches_the_page_and_validates(client_in, endpoint):
    add_records(endpoint, 3, mode=Mode.PROD, tok_s=30.0, baseline_tok_s=10.0, multiplier=3.0)
    url = reverse("dashboard-api:endpoint-timeseries", args=[endpoint.pk])

    data = client_in.get(url, {"metric": "multiplier", "range": "hour"}).json()
    bad_metric = client_in.get(url, {"metric": "nope"})
    bad_range = client_in.get(url, {"metric": "alpha", "range": "year"})

    assert [(s["name"], s["y"], s["n"]) for s in data["series"]] == [("prod", [3.0], [3])]
    assert data["bucket_seconds"] == 60
    assert bad_metric.status_code == 400 and "acceptance_rate" in json.dumps(bad_metric.json())
    assert bad_range.status_code == 400


def test_fleet_summary_and_distributions_api(client_in, endpoint):
    add_records(
        endpoint, 2, mode=Mode.PROD, tok_s=30.0, baseline_tok_s=10.0, multiplier=3.0, accepted_length_hist=[1, 2]
    )

    summary = client_in.get(reverse("dashboard-api:fleet-summary")).json()
    dist = client_in.get(reverse("dashboard-api:endpoint-distributions", args=[endpoint.pk])).json()

    assert summary[0]["name"] == "llama" and summary[0]["hour"]["multiplier"] == 3.0
    assert dist["histogram"] == {"prod": [2, 4]}


def test_timeseries_api_is_in_the_openapi_schema(client_in):
    schema = client_in.get(reverse("schema"), {"format": "json"}).json()
    assert "/api/v1/endpoints/{id}/timeseries/" in schema["paths"]
    assert "/api/v1/endpoints/{id}/projection/" in schema["paths"]


def test_policy_options_api_says_why_an_option_does_not_fit(client_in, endpoint):
    DraftModel.objects.create(name="other-vocab", kind=DraftKind.DRAFT_MODEL, path="/x", tokenizer_fingerprint="0" * 64)
    endpoint.status = EndpointStatus.UNREACHABLE
    endpoint.save()

    data = client_in.get(reverse("dashboard-api:endpoint-policy-options", args=[endpoint.pk])).json()

    modes = {o["value"]: o for o in data["modes"]}
    assert modes["off"]["available"] and modes["off"]["current"]
    assert modes["shadow"]["available"]
    assert not modes["prod"]["available"] and "prod needs a ready endpoint" in modes["prod"]["reason"]
    (draft,) = data["drafts"]
    assert not draft["available"] and "does not match" in draft["reason"]
    assert data["effective_path"] == "remote"


def test_draft_sizes_are_shown_in_decimal_units(client_in):
    DraftModel.objects.create(
        name="small", kind=DraftKind.DRAFT_MODEL, path="/x", param_count=68_000_000, vram_bytes=300 * 1024**2
    )
    body = client_in.get(reverse("speculation:draft-list")).content.decode()
    assert "68M params" in body and "300.0\xa0MB" in body
