"""Managed endpoints without a server process: switch requests (validation, 400s), the route move and the
rollback as database transactions, the supervisor's small rules, and vLLM 0.32's per-request acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.test import Client
from django.urls import reverse
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet import services as fleet_services
from fleet.adapters import ProbeReport, wire_for
from fleet.adapters.vllm_metrics import stats_from_request_metrics
from fleet.managed import switching
from fleet.managed.models import InstanceRole, InstanceState, ServerInstance, Switch, SwitchStatus
from fleet.managed.services import create_managed_endpoint, spec_args
from fleet.managed.supervisor import backoff_s, last_error
from fleet.models import Endpoint
from fleet.permissions import OPERATOR, grant_role
from speculation.models import PolicyChange, StageRecord
from speculation.services.policies import get_policy, update_policy

pytestmark = pytest.mark.django_db

FINGERPRINT = "f" * 64


@pytest.fixture
def user():
    user = get_user_model().objects.create_user(username="ops", password="pw-ops-123456")
    grant_role(user=user, role=OPERATOR)
    return user


@pytest.fixture
def endpoint(tmp_path: Path, user) -> Endpoint:
    directory = tmp_path / "target"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    endpoint = create_managed_endpoint(name="m", model_dir=str(directory), created_by=user, node_class="cpu")
    return endpoint


def _serving(endpoint: Endpoint, port: int = 41001) -> ServerInstance:
    """As the supervisor leaves it once the first instance serves."""
    instance = ServerInstance.objects.create(
        managed=endpoint.managed, role=InstanceRole.ACTIVE, state=InstanceState.STARTING, port=port
    )
    report = ProbeReport(
        capabilities={"served_model": "m", "tokenizer_fingerprint": FINGERPRINT, "native_speculation": False}
    )
    switching.activate(instance=instance, report=report, duration_ms=5.0, started=instance.started_at)
    endpoint.refresh_from_db()
    return instance


def test_activation_routes_the_endpoint_to_the_instance(endpoint):
    instance = _serving(endpoint)

    assert endpoint.base_url == "http://127.0.0.1:41001" and endpoint.status == "ready"
    assert endpoint.probes.filter(outcome="ready").count() == 1
    instance.refresh_from_db()
    assert instance.state == InstanceState.READY


def test_prod_on_a_managed_endpoint_that_is_not_serving_is_refused(endpoint):
    with pytest.raises(ValidationError) as caught:
        update_policy(endpoint=endpoint, mode="prod", mechanism="ngram", k=3)

    assert "mode" in caught.value.message_dict
    assert not Switch.objects.exists()


def test_a_server_changing_policy_change_waits_for_the_switch(endpoint, user):
    _serving(endpoint)

    policy = update_policy(endpoint=endpoint, user=user, mode="prod", mechanism="ngram", k=3)

    assert policy.mode == "off"  # nothing applied yet
    switch = Switch.objects.get()
    assert switch.speculation == {"draft_kind": "ngram", "draft_path": "", "k": 3}
    assert switch.fields["mode"] == "prod" and switch.fields["path"] == "native"
    # shadow runs the server as off does: applied at once, no switch
    with pytest.raises(ValidationError) as caught:
        update_policy(endpoint=endpoint, user=user, mode="prod", mechanism="ngram", k=4)
    assert "in progress" in caught.value.message_dict["mode"][0]


def test_a_second_switch_while_one_runs_is_a_400_through_the_api(endpoint, user):
    _serving(endpoint)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    url = f"/api/v1/endpoints/{endpoint.pk}/policy/"

    first = client.patch(url, {"mode": "prod", "mechanism": "ngram", "k": 3}, format="json")
    second = client.patch(url, {"k": 4}, format="json")

    assert first.status_code == 200, first.content
    assert second.status_code == 400 and "mode" in second.json()


def test_shadow_needs_no_new_server(endpoint, user):
    _serving(endpoint)

    policy = update_policy(endpoint=endpoint, user=user, mode="shadow", mechanism="ngram", k=3)

    assert policy.mode == "shadow" and not Switch.objects.exists()


def test_prod_on_aces_own_remote_path_keeps_the_plain_instance_and_needs_no_switch(endpoint, user):
    # given: a managed endpoint serving plain, whose vLLM scores token-id prompts (as the probe finds)
    _serving(endpoint)
    caps = {**endpoint.capabilities, "token_id_prompts": True, "prompt_scoring_method": "prompt_logprobs"}
    Endpoint.objects.filter(pk=endpoint.pk).update(capabilities=caps)
    endpoint.refresh_from_db()

    # when: prod on ACE's remote path
    policy = update_policy(endpoint=endpoint, user=user, mode="prod", mechanism="ngram", k=3, path="remote")

    # then: applied at once (ACE speculates against the plain server), no switch of the server
    assert policy.mode == "prod" and policy.path == "remote"
    assert not Switch.objects.exists()
    # and: prod on path auto would be the server's own speculation, a switch
    policy = update_policy(endpoint=endpoint, user=user, path="auto")
    assert policy.path == "remote"  # nothing applied before the new instance serves
    assert Switch.objects.get().fields["path"] == "native"


def test_completing_a_switch_moves_the_route_and_records_who_and_how_long(endpoint, user):
    old = _serving(endpoint)
    update_policy(endpoint=endpoint, user=user, mode="prod", mechanism="ngram", k=3)
    switch = Switch.objects.get()
    new = ServerInstance.objects.create(
        managed=endpoint.managed, role=InstanceRole.STANDBY, port=41002, speculation=switch.speculation
    )
    report = ProbeReport(
        capabilities={"served_model": "m", "tokenizer_fingerprint": FINGERPRINT, "native_speculation": True}
    )

    switching.complete_switch(
        switch=switch, instance=new, old=old, report=report, duration_ms=3.0, started=new.started_at
    )

    endpoint.refresh_from_db()
    assert endpoint.base_url == "http://127.0.0.1:41002" and endpoint.capabilities["native_speculation"] is True
    policy = get_policy(endpoint=endpoint)
    assert (policy.mode, policy.k, policy.path) == ("prod", 3, "native")
    change = PolicyChange.objects.filter(policy=policy).first()
    assert change.changed_by == user and change.changes["switch"]["outcome"] == "done"
    assert change.changes["mode"] == ["off", "prod"]
    old.refresh_from_db()
    assert old.role == InstanceRole.DRAINING and old.draining_since is not None
    assert endpoint.managed.__class__.objects.get(pk=endpoint.managed.pk).serving_speculation == switch.speculation


def test_a_failed_switch_leaves_the_policy_and_records_the_rollback(endpoint, user):
    _serving(endpoint)
    update_policy(endpoint=endpoint, user=user, mode="prod", mechanism="ngram", k=3)
    switch = Switch.objects.get()

    switching.fail_switch(switch=switch, reason="the new instance exited with code 1", log_tail="OSError: no model")

    switch.refresh_from_db()
    assert switch.status == SwitchStatus.FAILED and switch.duration_s is not None
    policy = get_policy(endpoint=endpoint)
    assert policy.mode == "off"
    change = PolicyChange.objects.filter(policy=policy).first()
    assert change.changes["switch"]["outcome"] == "rolled back"
    assert change.changes["switch"]["requested"]["mode"] == ["off", "prod"]
    assert endpoint.managed.events.filter(kind="switch_failed", log_tail__contains="OSError").exists()


def test_ace_sets_the_url_and_kind_of_a_managed_endpoint(endpoint):
    _serving(endpoint)

    with pytest.raises(ValidationError) as caught:
        fleet_services.update_endpoint(endpoint=endpoint, base_url="http://127.0.0.1:9", kind="sglang")

    assert set(caught.value.message_dict) == {"base_url", "kind"}


def test_vllm_runs_with_per_request_acceptance_when_it_speculates():
    args = spec_args(server_kind="vllm", speculation={"draft_kind": "ngram", "draft_path": "", "k": 3})

    assert args[0] == "--speculative-config" and json.loads(args[1])["num_speculative_tokens"] == 3
    assert args[2:] == ["--per-request-spec-decode-metrics", "summary"]
    assert spec_args(server_kind="vllm", speculation={}) == []


def test_per_request_acceptance_in_vllm_0_32s_shape():
    # 4 verify steps with K=3: accepted 0, 1, 3 and 3 drafts (histogram over accepted counts 0..3)
    spec = {
        "mean_acceptance_length": 2.75,
        "draft_acceptance_rate": 7 / 12,
        "acceptance_histogram": [1, 1, 0, 2],
        "num_spec_steps": 4,
        "num_accepted_draft_tokens": 7,
        "num_draft_tokens": 12,
        "num_spec_tokens": 3,
    }

    stats = stats_from_request_metrics(spec)

    assert (stats["target_passes"], stats["drafted_tokens"], stats["accepted_tokens"]) == (4, 12, 7)
    assert stats["per_position_acceptance"] == [3 / 4, 2 / 4, 2 / 4]
    assert stats["mean_accepted_len"] == pytest.approx(2.75) and stats["k"] == 3


def test_supervisor_rules():
    assert [backoff_s(n) for n in (1, 2, 3, 10)] == [1.0, 2.0, 4.0, 60.0]
    metrics = 'vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_waiting{engine="0"} 1.0\nother 5\n'
    assert wire_for("vllm").parse_in_flight(metrics) == 3.0  # what a draining instance still serves
    assert last_error("INFO start\nValueError: no such model\nINFO bye") == "ValueError: no such model"


def test_a_record_takes_the_baseline_of_the_load_it_started_under():
    from fleet.adapters.vllm_metrics import requests_running
    from fleet.managed.baseline import pick

    buckets = {"1": 20.0, "4": 12.0}
    assert pick(buckets, 1) == (1, 20.0)
    assert pick(buckets, 3) == (1, 20.0)
    assert pick(buckets, 9) == (4, 12.0)
    assert pick({}, 2) is None
    assert requests_running('vllm:num_requests_running{engine="0"} 3.0\nvllm:num_requests_waiting 1\n') == 3.0


def test_the_baseline_is_re_measured_on_demand_only_without_speculation(endpoint, user):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    url = f"/api/v1/endpoints/{endpoint.pk}/managed/baseline/"

    accepted = client.post(url)
    endpoint.managed.__class__.objects.filter(pk=endpoint.managed.pk).update(
        serving_speculation={"draft_kind": "ngram", "draft_path": "", "k": 3}
    )
    refused = client.post(url)

    assert accepted.status_code == 202
    assert refused.status_code == 400 and "baseline" in refused.json()


def test_one_supervisor_per_node_class_holds_the_lease(redis_server):
    from fleet.managed.supervisor import Supervisor

    first, spare = Supervisor(node_class="lease-test"), Supervisor(node_class="lease-test")
    spare._lease_holder = "other-host:1"

    assert first._hold_lease() is True
    assert spare._hold_lease() is False
    assert first._hold_lease() is True  # renewed by its holder
    first._release_lease()
    assert spare._hold_lease() is True
    spare._release_lease()


def test_the_dashboard_shows_a_managed_endpoints_native_multiplier(endpoint, user):
    # native multipliers on the dashboard like the other paths (records as the gateway writes
    # them for a managed endpoint in prod: path native, the baseline of the same server without speculation).
    _serving(endpoint)
    StageRecord.objects.create(
        endpoint=endpoint,
        request_id="native-1",
        mode="prod",
        action="speculated",
        path="native",
        mechanism="ngram",
        k=3,
        drafted_tokens=12,
        accepted_tokens=7,
        tok_s=23.7,
        baseline_tok_s=20.0,
        multiplier=1.37,
    )
    browser = Client()
    browser.force_login(user)

    overview = browser.get(reverse("speculation:overview")).content.decode()
    url = reverse("speculation:endpoint", args=[endpoint.pk])
    page, records = (browser.get(url, {"view": v}).content.decode() for v in ("overview", "records"))
    settings = browser.get(url, {"view": "settings"}).content.decode()

    assert '<span class="measured">1.37×</span>' in overview
    assert "1.37× measured in prod" in page and "1.37×" in records and "native" in settings


def test_the_lease_is_kept_while_a_long_step_blocks_the_loop(redis_server, monkeypatch):
    # The canary and the baseline block the supervisor's loop for longer than the lease; a renewal thread keeps
    # it meanwhile. The lease is shortened to 4 s and the step lasts 9 s: without renewal the spare takes it
    # (renewals every 1.3 s leave 2.7 s of slack for a loaded machine).
    import time

    from fleet.managed import supervisor as supervisor_module
    from fleet.managed.supervisor import Supervisor

    monkeypatch.setattr(supervisor_module, "LEASE_S", 4)
    holder, spare = Supervisor(node_class="lease-kept"), Supervisor(node_class="lease-kept")
    spare._lease_holder = "other-host:1"
    assert holder._hold_lease() is True

    with holder._lease_kept():
        time.sleep(9)
        assert spare._hold_lease() is False

    holder._release_lease()


def _head(tmp_path: Path, config: dict):
    from speculation.models import DraftModel

    directory = tmp_path / f"head-{len(config)}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return DraftModel.objects.create(
        name=directory.name, kind="eagle_head", path=str(directory), tokenizer_fingerprint=FINGERPRINT
    )


def test_prod_native_with_an_eagle3_head_switches_the_server_to_draft_with_it(endpoint, user, tmp_path):
    # given: a managed vLLM serving plain, and an EAGLE-3 head (vLLM's layout: what --multi-layer training saves)
    _serving(endpoint)
    head = _head(tmp_path, {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"})

    # when: prod with the head on path native
    update_policy(endpoint=endpoint, user=user, mode="prod", mechanism="eagle_head", draft=head, k=3, path="native")

    # then: a blue/green switch to a server started with vLLM's eagle3 flags for the head
    switch = Switch.objects.get()
    assert switch.speculation == {"draft_kind": "eagle_head", "draft_path": head.path, "k": 3}
    config = json.loads(spec_args(server_kind="vllm", speculation=switch.speculation)[1])
    assert config == {"method": "eagle3", "model": head.path, "num_speculative_tokens": 3}


def test_a_head_the_server_cannot_load_or_the_remote_path_is_refused_naming_why(endpoint, user, tmp_path):
    _serving(endpoint)
    caps = {**endpoint.capabilities, "token_id_prompts": True, "prompt_scoring_method": "prompt_logprobs"}
    Endpoint.objects.filter(pk=endpoint.pk).update(capabilities=caps)
    endpoint.refresh_from_db()
    old = _head(tmp_path, {"ace_eagle": {"format": 2}, "model_type": "llama"})
    head = _head(tmp_path, {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "x": 1})

    with pytest.raises(ValidationError) as native:
        update_policy(endpoint=endpoint, user=user, mode="prod", mechanism="eagle_head", draft=old, path="native")
    with pytest.raises(ValidationError) as remote:
        update_policy(endpoint=endpoint, user=user, mode="prod", mechanism="eagle_head", draft=head, path="remote")

    assert "format 2" in str(native.value) and "local path only" in str(native.value)
    assert "scoring call does not return" in str(remote.value)
    assert not Switch.objects.exists()
