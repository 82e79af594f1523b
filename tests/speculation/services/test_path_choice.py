"""path: auto chooses by measured speed, is fixed when the policy is saved, and moves only by a policy change."""

from __future__ import annotations

import pytest

from fleet.models import Endpoint
from speculation.models import Action, Mode, PolicyChange, SpeculationPolicy, StageRecord
from speculation.services.policies import path_warning, reevaluate_path, resolve_path, update_policy
from tests.support.models import serves

pytestmark = pytest.mark.django_db

REMOTE_CAPS = {"token_id_prompts": True, "prompt_scoring_method": "prompt_logprobs", "max_context": 1024}


def _endpoint(**caps) -> Endpoint:
    return Endpoint.objects.create(
        name="ep", base_url="http://127.0.0.1:9", status="ready", served_model="m", capabilities={**caps}
    )


def _measure(endpoint: Endpoint, *, path: str, multiplier: float, n: int = 3, mode: str = Mode.PROD) -> None:
    action = Action.SPECULATED if mode == Mode.PROD else Action.WOULD_SPECULATE
    for i in range(n):
        StageRecord.objects.create(
            endpoint=endpoint, request_id=f"{path}-{multiplier}-{i}", mode=mode, action=action, path=path,
            multiplier=multiplier,
        )  # fmt: skip


def _policy(endpoint: Endpoint) -> SpeculationPolicy:
    return SpeculationPolicy.objects.get(endpoint=endpoint)


def _prod(endpoint: Endpoint, target_dir) -> None:
    serves(endpoint, target_dir)
    update_policy(endpoint=endpoint, mode="prod", mechanism="ngram", k=3, target_path=str(target_dir))


def test_auto_prefers_local_to_remote_before_anything_is_measured_and_records_why(tiny_model_dir):
    endpoint = _endpoint(**REMOTE_CAPS)
    _prod(endpoint, tiny_model_dir)
    policy = _policy(endpoint)
    assert resolve_path(policy=policy, endpoint=endpoint) == "local"
    change = PolicyChange.objects.get()
    assert change.changes["resolved_path"] == [None, "local"]
    assert "remote: no measurement yet" in change.changes["path_evidence"][1]
    assert {e["path"]: e["runnable"] for e in policy.path_evidence} == {"native": False, "local": True, "remote": True}


def test_a_path_measured_slower_than_plain_is_never_chosen_automatically(tiny_model_dir):
    endpoint = _endpoint(**REMOTE_CAPS)
    _measure(endpoint, path="local", multiplier=0.8)
    _measure(endpoint, path="remote", multiplier=0.3)
    serves(endpoint, tiny_model_dir)
    update_policy(endpoint=endpoint, mechanism="ngram", target_path=str(tiny_model_dir))  # off: saved anyway
    assert _policy(endpoint).resolved_path == ""
    with pytest.raises(Exception, match="slower than plain"):
        update_policy(endpoint=endpoint, mode="prod")
    # a faster measurement of remote makes it eligible again, through an explicit re-evaluation
    _measure(endpoint, path="remote", multiplier=1.4, n=20)
    assert "would choose remote" in path_warning(policy=_policy(endpoint), endpoint=endpoint)
    assert reevaluate_path(endpoint=endpoint).resolved_path == "remote"


def test_measured_speed_outranks_the_design_order(tiny_model_dir):
    endpoint = _endpoint(**REMOTE_CAPS, native_speculation=True)
    _measure(endpoint, path="native", multiplier=1.2)
    _measure(endpoint, path="local", multiplier=1.9)
    _prod(endpoint, tiny_model_dir)
    assert _policy(endpoint).resolved_path == "local"
    evidence = {e["path"]: e for e in _policy(endpoint).path_evidence}
    assert (evidence["native"]["measured"], evidence["local"]["measured"]) == (1.2, 1.9)


def test_a_reprobe_does_not_move_the_path_but_warns_until_re_evaluated(tiny_model_dir):
    # given: saved with the server not scoring prompts, so auto is local
    endpoint = _endpoint()
    _measure(endpoint, path="remote", multiplier=1.5)
    _prod(endpoint, tiny_model_dir)
    assert _policy(endpoint).resolved_path == "local"
    _measure(endpoint, path="local", multiplier=1.1)
    # when: a re-probe finds that the server now scores prompts (remote measured faster before)
    endpoint.capabilities = REMOTE_CAPS
    endpoint.save()
    # then: prod keeps the saved path; the page warns; only an explicit re-evaluation (recorded) moves it
    assert resolve_path(policy=_policy(endpoint), endpoint=endpoint) == "local"
    assert "would choose remote" in path_warning(policy=_policy(endpoint), endpoint=endpoint)
    changes_before = PolicyChange.objects.count()
    policy = reevaluate_path(endpoint=endpoint)
    assert resolve_path(policy=policy, endpoint=endpoint) == "remote"
    assert PolicyChange.objects.count() == changes_before + 1
    assert PolicyChange.objects.first().changes["resolved_path"] == ["local", "remote"]
    assert path_warning(policy=policy, endpoint=endpoint) == ""


def test_the_endpoint_page_shows_the_choice_its_evidence_and_the_warning(client, user, tiny_model_dir):
    endpoint = _endpoint()
    _prod(endpoint, tiny_model_dir)
    endpoint.capabilities = REMOTE_CAPS
    endpoint.save()
    _measure(endpoint, path="remote", multiplier=2.0)
    client.force_login(user)
    page = client.get(f"/dashboard/endpoints/{endpoint.pk}/").content.decode()
    assert "chosen" in page and "local: no measurement yet" in page
    assert "would choose remote" in page
    reply = client.post(f"/dashboard/endpoints/{endpoint.pk}/path/")
    assert reply.status_code == 302
    assert _policy(endpoint).resolved_path == "remote"


def test_rest_re_evaluation_answers_the_policy(api, tiny_model_dir):
    endpoint = _endpoint(**REMOTE_CAPS)
    _prod(endpoint, tiny_model_dir)
    reply = api.post(f"/api/v1/endpoints/{endpoint.pk}/policy/path/")
    assert reply.status_code == 200, reply.content
    body = reply.json()
    assert (body["resolved_path"], body["path_warning"]) == ("local", "")
    assert [e["path"] for e in body["path_evidence"]] == ["native", "local", "remote"]
