"""`draft: auto`: ACE applies auto-pairing's winner itself, only with enough evidence and a clear margin
(hysteresis), and the change history says "auto" with the evidence."""

from __future__ import annotations

import pytest

from fleet.models import Endpoint, EndpointStatus
from speculation.models import CandidateMeasurement, DraftKind, DraftModel, PolicyChange, SpeculationPolicy
from speculation.services.autopairing import AUTO_MARGIN, AUTO_MIN_REQUESTS, auto_apply

pytestmark = pytest.mark.django_db

FP = "b" * 64


@pytest.fixture
def endpoint():
    endpoint = Endpoint.objects.create(
        name="auto", base_url="http://127.0.0.1:9/", status=EndpointStatus.READY,
        capabilities={"tokenizer_fingerprint": FP},
    )  # fmt: skip
    SpeculationPolicy.objects.create(endpoint=endpoint, mode="shadow", mechanism="ngram", k=5, auto_pairing=True)
    return endpoint


@pytest.fixture
def draft():
    return DraftModel.objects.create(name="small", kind=DraftKind.DRAFT_MODEL, path="/x", tokenizer_fingerprint=FP)


def measure(
    endpoint, draft, *, requests: int, ngram_at_5: float, small_at_3: float, spread: float = 0.02, hybrid_at_2=None
):
    """`requests` shadowed requests, each with both candidates replayed (draws alternate +-spread), and the
    hybrid of suffix decoding and `small` when `hybrid_at_2` is given."""
    for i in range(requests):
        jitter = spread if i % 2 else -spread
        candidates = [("ngram", "ngram", None, 5, ngram_at_5), ("small", "draft_model", draft, 3, small_at_3)]
        if hybrid_at_2 is not None:
            candidates.append(("suffix+small", "suffix_draft", draft, 2, hybrid_at_2))
        for name, kind, the_draft, peak_k, peak in candidates:
            CandidateMeasurement.objects.create(
                endpoint=endpoint, request_id=f"r{i}", workload="code", candidate=name, kind=kind, draft=the_draft,
                multiplier=[round(peak + jitter - 0.1 * abs(k - peak_k), 4) for k in range(1, 9)],
                mean_accepted_len=[2.0] * 8, counts=[[k, 1, 3] for k in range(1, 9)],
            )  # fmt: skip


def test_a_clearly_better_candidate_with_enough_evidence_is_applied_and_recorded_as_auto(endpoint, draft):
    measure(endpoint, draft, requests=AUTO_MIN_REQUESTS, ngram_at_5=1.1, small_at_3=1.6)

    policy = auto_apply(endpoint=endpoint)

    assert policy is not None and (policy.mechanism, policy.draft.name, policy.k) == ("draft_model", "small", 3)
    change = PolicyChange.objects.get(policy=policy)
    assert change.changed_by is None
    assert change.changes["draft"] == [None, "small"] and change.changes["k"] == [5, 3]
    evidence = change.changes["auto"][1]
    assert "small at K = 3 projects 1.60x" in evidence and f"over {AUTO_MIN_REQUESTS} requests" in evidence
    assert "vs ngram at K = 5 1.10x" in evidence
    assert auto_apply(endpoint=endpoint) is None  # the winner is now the current pairing: nothing flips back


def test_a_lead_inside_the_margin_does_not_switch(endpoint, draft):
    # small leads by 3 %: below the margin, however many requests
    measure(endpoint, draft, requests=3 * AUTO_MIN_REQUESTS, ngram_at_5=1.5, small_at_3=1.5 * (1 + AUTO_MARGIN / 2))

    assert auto_apply(endpoint=endpoint) is None
    policy = SpeculationPolicy.objects.get(endpoint=endpoint)
    assert (policy.mechanism, policy.k) == ("ngram", 5) and not PolicyChange.objects.exists()


def test_too_little_evidence_does_not_switch(endpoint, draft):
    measure(endpoint, draft, requests=AUTO_MIN_REQUESTS - 1, ngram_at_5=1.1, small_at_3=1.6)
    assert auto_apply(endpoint=endpoint) is None


def test_without_draft_auto_nothing_is_applied(endpoint, draft):
    SpeculationPolicy.objects.filter(endpoint=endpoint).update(auto_pairing=False)
    measure(endpoint, draft, requests=AUTO_MIN_REQUESTS, ngram_at_5=1.1, small_at_3=1.6)
    assert auto_apply(endpoint=endpoint) is None


def test_on_a_managed_native_endpoint_the_switch_says_it_is_the_best_overall(endpoint, draft):
    # given: a managed endpoint whose prod runs on the server's own speculation (one configuration at a time)
    from fleet.managed.models import ManagedServer

    ManagedServer.objects.create(endpoint=endpoint, model_dir="/models/t", served_name="t")
    SpeculationPolicy.objects.filter(endpoint=endpoint).update(path="native")
    measure(endpoint, draft, requests=AUTO_MIN_REQUESTS, ngram_at_5=1.1, small_at_3=1.6)

    policy = auto_apply(endpoint=endpoint)

    evidence = PolicyChange.objects.get(policy=policy).changes["auto"][1]
    assert evidence.startswith("native path on a managed endpoint (one server configuration at a time, not per ")
    assert "the endpoint's best overall, every workload pooled: small at K = 3 projects 1.60x" in evidence


def test_on_aces_own_paths_the_switch_sets_the_fallback_for_workloads_without_evidence(endpoint, draft):
    SpeculationPolicy.objects.filter(endpoint=endpoint).update(path="local")
    measure(endpoint, draft, requests=AUTO_MIN_REQUESTS, ngram_at_5=1.1, small_at_3=1.6)

    policy = auto_apply(endpoint=endpoint)

    evidence = PolicyChange.objects.get(policy=policy).changes["auto"][1]
    assert evidence.startswith("the endpoint's best overall (what prod runs where a workload's own evidence is short)")


def test_on_the_native_path_auto_applies_the_best_candidate_the_server_can_run(endpoint, draft):
    # given: a managed native endpoint where the hybrid (ACE's worker only) leads overall, the draft model next
    from fleet.managed.models import ManagedServer

    ManagedServer.objects.create(endpoint=endpoint, model_dir="/models/t", served_name="t")
    SpeculationPolicy.objects.filter(endpoint=endpoint).update(path="native")
    measure(endpoint, draft, requests=AUTO_MIN_REQUESTS, ngram_at_5=1.1, small_at_3=1.6, hybrid_at_2=2.0)

    policy = auto_apply(endpoint=endpoint)

    # then: the draft model, not a refused switch to the hybrid, and the history says why the leader was passed
    assert policy is not None and (policy.mechanism, policy.draft.name, policy.k) == ("draft_model", "small", 3)
    evidence = PolicyChange.objects.get(policy=policy).changes["auto"][1]
    assert "small at K = 3 projects 1.60x" in evidence
    assert "(suffix+small leads at 2.00x but cannot run on this endpoint's path)" in evidence


def test_on_aces_own_paths_the_hybrid_leader_is_applied(endpoint, draft):
    SpeculationPolicy.objects.filter(endpoint=endpoint).update(path="remote")
    measure(endpoint, draft, requests=AUTO_MIN_REQUESTS, ngram_at_5=1.1, small_at_3=1.6, hybrid_at_2=2.0)

    policy = auto_apply(endpoint=endpoint)

    assert policy is not None and (policy.mechanism, policy.draft.name, policy.k) == ("suffix_draft", "small", 2)
    assert "cannot run" not in PolicyChange.objects.get(policy=policy).changes["auto"][1]


def test_a_switch_to_a_draft_trained_on_captured_traffic_says_what_it_was_trained_on(endpoint, draft):
    from speculation.models import TrainingRun

    run = TrainingRun.objects.create(
        name="from-traffic", target_dir="/t", out_dir="/o", prompts=f"captured:{endpoint.pk}:code", draft=draft
    )
    measure(endpoint, draft, requests=AUTO_MIN_REQUESTS, ngram_at_5=1.1, small_at_3=1.6)

    policy = auto_apply(endpoint=endpoint)

    change = PolicyChange.objects.get(policy=policy)
    assert change.changes["trained_on"] == [None, f"training run {run.pk} on captured:{endpoint.pk}:code"]
    assert "small at K = 3 projects 1.60x" in change.changes["auto"][1]  # and what shadow measured


def test_a_managed_switch_to_a_draft_trained_on_captured_traffic_says_what_it_was_trained_on(tmp_path, draft):
    # given: a managed endpoint serving the server's own n-gram speculation in prod, with `draft: auto`
    import json

    from fleet.adapters import ProbeReport
    from fleet.managed import switching
    from fleet.managed.models import InstanceRole, InstanceState, ServerInstance, Switch
    from fleet.managed.services import create_managed_endpoint, speculation_of
    from speculation.models import TrainingRun

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    endpoint = create_managed_endpoint(name="auto-managed", model_dir=str(tmp_path), node_class="cpu")
    report = ProbeReport(capabilities={"served_model": "m", "tokenizer_fingerprint": FP, "native_speculation": True})
    old = ServerInstance.objects.create(managed=endpoint.managed, role=InstanceRole.ACTIVE, port=41001)
    switching.activate(instance=old, report=report, duration_ms=1.0, started=old.started_at)
    endpoint.refresh_from_db()
    policy = SpeculationPolicy.objects.create(
        endpoint=endpoint, mode="prod", mechanism="ngram", k=5, path="native", auto_pairing=True
    )
    endpoint.managed.__class__.objects.filter(pk=endpoint.managed.pk).update(serving_speculation=speculation_of(policy))
    run = TrainingRun.objects.create(
        name="from-traffic", target_dir="/t", out_dir="/o", prompts=f"captured:{endpoint.pk}", draft=draft
    )
    measure(endpoint, draft, requests=AUTO_MIN_REQUESTS, ngram_at_5=1.1, small_at_3=1.6)

    # when: auto-pairing switches, blue/green, and the new instance serves
    auto_apply(endpoint=endpoint)
    switch = Switch.objects.get(managed=endpoint.managed)
    new = ServerInstance.objects.create(
        managed=endpoint.managed, role=InstanceRole.STANDBY, state=InstanceState.STARTING, port=41002
    )
    switching.complete_switch(switch=switch, instance=new, old=old, report=report, duration_ms=1.0, started=None)

    # then: the recorded change names the run and its data, and what shadow measured, beside the switch
    change = PolicyChange.objects.filter(policy__endpoint=endpoint).first()
    assert change.changes["switch"]["outcome"] == "done" and change.changes["draft"] == [None, "small"]
    assert change.changes["trained_on"] == [None, f"training run {run.pk} on captured:{endpoint.pk}"]
    assert "small at K = 3 projects 1.60x" in change.changes["auto"][1]
