"""The switch canary without a server process: its comparison (fake servers answering through canary._complete),
and what the supervisor does with its outcome (route moved, or switch refused and rolled back with the reason on
the page, in the change history and in the REST state; skipped by the setting; not needed for a plain instance).
The real vLLM defect it catches is asserted in test_managed_switch.py."""

from __future__ import annotations

import threading

import pytest
from django.test import Client
from django.urls import reverse
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet.adapters import ProbeReport
from fleet.managed import canary
from fleet.managed.models import InstanceRole, InstanceState, ServerInstance, Switch, SwitchStatus
from fleet.managed.supervisor import Supervisor
from speculation.models import PolicyChange
from speculation.services.policies import get_policy, update_policy

pytestmark = pytest.mark.django_db

OLD, NEW = "http://old", "http://new"
RIGHT = {p: f"right answer {i}" for i, p in enumerate(canary.PROMPTS)}
BATCH = len(canary.PROMPTS) * (canary.GREEDY_EACH + canary.SAMPLED_EACH)


class FakeServers:
    """Answers canary._complete for the old instance (plain: always right) and the new one. A defective new one
    answers a greedy request wrongly when it runs at the same time as sampled ones: the mixed batch's requests
    wait for each other at a barrier (all in flight at once, as in one server batch); reference requests come
    alone (from the calling thread)."""

    def __init__(self, *, defective: bool, new_fails: bool = False, old: str = OLD) -> None:
        self.defective, self.new_fails, self.old = defective, new_fails, old
        self.barrier = threading.Barrier(BATCH, timeout=10)
        self.calls: list[tuple[str, float]] = []

    def __call__(self, base_url: str, model: str, prompt: str, temperature: float) -> str:
        self.calls.append((base_url, temperature))
        if base_url == self.old:
            return RIGHT[prompt]
        if self.new_fails:
            raise canary.httpx.ConnectError("connection refused")
        if threading.current_thread() is threading.main_thread():
            return RIGHT[prompt]  # sent alone
        self.barrier.wait()
        if temperature > 0:
            return "sampled text"
        return "!!!!!!garbled" if self.defective else RIGHT[prompt]


@pytest.fixture
def servers(monkeypatch):
    def install(**kwargs) -> FakeServers:
        fake = FakeServers(**kwargs)
        monkeypatch.setattr(canary, "_complete", fake)
        return fake

    return install


def test_the_canary_catches_wrong_greedy_answers_in_a_mixed_batch(servers):
    fake = servers(defective=True)

    result = canary.run(new_url=NEW, model="m", old_url=OLD)

    assert result.refused and result.outcome == canary.FAILED
    assert canary.DEFECT in result.reason and "vLLM defect" in result.reason
    greedy = len(canary.PROMPTS) * canary.GREEDY_EACH
    assert (result.greedy, result.mismatches) == (greedy, greedy)
    assert result.reference == "the old instance, without speculation"
    record = result.record()
    assert record["first_mismatch"]["got"] == "!!!!!!garbled"
    assert record["requests"] == len(fake.calls) == len(canary.PROMPTS) + BATCH  # a handful of requests
    assert sum(1 for url, t in fake.calls if url == NEW and t > 0) == len(canary.PROMPTS) * canary.SAMPLED_EACH


def test_without_a_plain_old_instance_the_reference_is_the_new_one_alone(servers):
    servers(defective=True)

    result = canary.run(new_url=NEW, model="m", old_url=None)

    assert result.refused and result.reference == "the new instance, each prompt alone"


def test_a_right_server_passes(servers):
    servers(defective=False)

    result = canary.run(new_url=NEW, model="m", old_url=OLD)

    assert result.outcome == canary.PASSED and result.mismatches == 0 and not result.refused


def test_a_new_instance_that_does_not_answer_fails_the_canary(servers):
    servers(defective=False, new_fails=True)

    result = canary.run(new_url=NEW, model="m", old_url=OLD)

    assert result.refused and "did not answer" in result.reason and "ConnectError" in result.reason


def _standby_for(switch: Switch, port: int = 41002) -> ServerInstance:
    return ServerInstance.objects.create(
        managed=switch.managed,
        role=InstanceRole.STANDBY,
        state=InstanceState.STARTING,
        port=port,
        speculation=switch.speculation,
    )


def _probed() -> tuple:
    report = ProbeReport(
        capabilities={"served_model": "m", "tokenizer_fingerprint": "f" * 64, "native_speculation": True}
    )
    return report, 3.0, None


def _route(switch: Switch, old: ServerInstance) -> ServerInstance:
    """The supervisor's step once the standby is ready and probed."""
    standby = _standby_for(switch)
    switch.refresh_from_db()
    supervisor = Supervisor(node_class="cpu")
    supervisor._route_after_canary(switch.managed, switch, old, standby, _probed())
    switch.refresh_from_db()
    return standby


def test_a_refused_switch_keeps_the_plain_instance_and_says_why_everywhere(
    servers, managed_endpoint, serving, operator
):
    old = serving(managed_endpoint)
    fake = servers(defective=True, old=old.base_url)
    update_policy(endpoint=managed_endpoint, user=operator, mode="prod", mechanism="ngram", k=3)
    switch = Switch.objects.get()
    assert switch.canary == {"outcome": canary.PENDING, "reason": ""}

    standby = _route(switch, old)

    assert (old.base_url, 0.0) in fake.calls  # the plain instance gave the reference
    assert switch.status == SwitchStatus.FAILED and canary.DEFECT in switch.reason
    assert f"stays on instance {old.pk}" in switch.reason
    assert switch.canary["outcome"] == canary.FAILED and switch.canary["mismatches"] > 0
    managed_endpoint.refresh_from_db()
    assert managed_endpoint.base_url == old.base_url
    standby.refresh_from_db()
    assert standby.state == InstanceState.FAILED
    policy = get_policy(endpoint=managed_endpoint)
    assert policy.mode == "off"
    change = PolicyChange.objects.filter(policy=policy).first()
    assert change.changes["switch"]["outcome"] == "rolled back"
    assert change.changes["switch"]["canary"]["outcome"] == canary.FAILED
    # the endpoint page says so, and what prod then means
    browser = Client()
    browser.force_login(operator)
    page = browser.get(reverse("fleet:endpoint-detail", kwargs={"pk": managed_endpoint.pk})).content.decode()
    assert 'id="managed-canary-refusal"' in page and "Prod refused by the switch canary" in page
    assert "wrong greedy output under mixed batches" in page and "ACE_MANAGED_CANARY=false" in page
    # and the REST state
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=operator).key}")
    state = api.get(f"/api/v1/endpoints/{managed_endpoint.pk}/managed/").json()
    assert state["switches"][0]["canary"]["outcome"] == canary.FAILED
    assert canary.DEFECT in state["canary_refusal"]["reason"]


def test_a_switch_that_passes_the_canary_moves_the_route_and_records_it(servers, managed_endpoint, serving, operator):
    old = serving(managed_endpoint)
    servers(defective=False, old=old.base_url)
    update_policy(endpoint=managed_endpoint, user=operator, mode="prod", mechanism="ngram", k=3)

    standby = _route(Switch.objects.get(), old)

    managed_endpoint.refresh_from_db()
    assert managed_endpoint.base_url == standby.base_url
    change = PolicyChange.objects.filter(policy=get_policy(endpoint=managed_endpoint)).first()
    assert change.changes["switch"]["outcome"] == "done"
    assert change.changes["switch"]["canary"]["outcome"] == canary.PASSED
    page = _page(managed_endpoint, operator)
    assert "Prod refused" not in page and "passed" in page


def test_the_setting_skips_the_canary_and_the_switch_says_so(
    servers, managed_endpoint, serving, operator, settings, monkeypatch
):
    settings.MANAGED_SWITCH_CANARY = False
    monkeypatch.setattr(canary, "run", lambda **_: pytest.fail("the canary ran although turned off"))
    old = serving(managed_endpoint)
    update_policy(endpoint=managed_endpoint, user=operator, mode="prod", mechanism="ngram", k=3)
    switch = Switch.objects.get()

    _route(switch, old)

    assert switch.status == SwitchStatus.DONE
    assert switch.canary == {"outcome": canary.SKIPPED, "reason": "turned off (ACE_MANAGED_CANARY=false)"}
    assert "ACE_MANAGED_CANARY=false" in _page(managed_endpoint, operator)


def test_a_switch_to_a_plain_instance_needs_no_canary(managed_endpoint, serving, operator, monkeypatch):
    monkeypatch.setattr(canary, "run", lambda **_: pytest.fail("a plain instance needs no canary"))
    old = serving(managed_endpoint)
    ServerInstance.objects.filter(pk=old.pk).update(speculation={"draft_kind": "ngram", "draft_path": "", "k": 3})
    old.refresh_from_db()
    managed_endpoint.managed.__class__.objects.filter(pk=managed_endpoint.managed.pk).update(
        serving_speculation=old.speculation
    )
    update_policy(endpoint=managed_endpoint, user=operator, mode="shadow")
    switch = Switch.objects.get()

    _route(switch, old)

    assert switch.status == SwitchStatus.DONE and switch.canary["outcome"] == canary.NOT_NEEDED


def test_a_switch_that_fails_before_the_canary_says_it_did_not_run(managed_endpoint, serving, operator):
    from fleet.managed import switching

    serving(managed_endpoint)
    update_policy(endpoint=managed_endpoint, user=operator, mode="prod", mechanism="ngram", k=3)
    switch = Switch.objects.get()

    switching.fail_switch(switch=switch, reason="the new instance exited with code 1")

    switch.refresh_from_db()
    assert switch.canary["outcome"] == canary.NOT_RUN
    assert "Prod refused" not in _page(managed_endpoint, operator)  # not the canary's refusal


def _page(endpoint, user) -> str:
    browser = Client()
    browser.force_login(user)
    return browser.get(reverse("fleet:endpoint-detail", kwargs={"pk": endpoint.pk})).content.decode()
