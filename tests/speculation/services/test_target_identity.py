"""target_path must hold the endpoint's own model: a checkpoint with the same tokenizer that does not reproduce the
served model's answers on the canary is refused at policy save (REST and the settings form), saying what differed."""

from __future__ import annotations

import os

import pytest

from fleet.models import Endpoint, EndpointStatus
from speculation.models import SpeculationPolicy
from speculation.services import target_identity
from speculation.services.model_files import tokenizer_fingerprint
from tests.support.models import served_reference_of, serves

pytestmark = pytest.mark.django_db


def _endpoint(model_dir, *, name: str = "ep") -> Endpoint:
    """A ready endpoint whose probe found the tokenizer and the canary reference of the model in model_dir."""
    endpoint = Endpoint.objects.create(
        name=name,
        base_url="http://127.0.0.1:9",
        status=EndpointStatus.READY,
        served_model="m",
        capabilities={"tokenizer_fingerprint": tokenizer_fingerprint(model_dir, field="target_path")},
    )
    serves(endpoint, model_dir)
    return endpoint


def _record(endpoint: Endpoint, reference: dict) -> None:
    endpoint.capabilities = {**endpoint.capabilities, "canary_reference": reference}
    Endpoint.objects.filter(pk=endpoint.pk).update(capabilities=endpoint.capabilities)


def _url(endpoint: Endpoint) -> str:
    return f"/api/v1/endpoints/{endpoint.pk}/policy/"


def test_it_refuses_the_demo_draft_as_the_demo_targets_folder_naming_the_differing_token(api, demo_pair):
    # given: the demo endpoint in prod on the local path (its server runs the demo target)
    endpoint = _endpoint(demo_pair.target_dir, name="demo")
    SpeculationPolicy.objects.create(endpoint=endpoint, mode="prod", mechanism="ngram", path="local")
    # when: target_path is the demo draft's folder (same tokenizer, another model)
    response = api.patch(_url(endpoint), {"target_path": str(demo_pair.draft_dir)}, format="json")
    # then: 400, saying where the greedy continuation differs, in both models' tokens; nothing saved
    assert response.status_code == 400, response.content
    message = response.json()["target_path"][0]
    assert message.startswith("target_path does not reproduce the endpoint's model: greedy continuation"), message
    assert "differs at token" in message and "(server '" in message and ", local '" in message
    assert SpeculationPolicy.objects.get(endpoint=endpoint).target_path == ""
    # and the demo target itself passes
    response = api.patch(_url(endpoint), {"target_path": str(demo_pair.target_dir)}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["target_path"] == str(demo_pair.target_dir.resolve())


def test_another_checkpoint_is_refused_through_the_settings_form_too(client, user, tiny_model_dir, other_model_dir):
    endpoint = _endpoint(tiny_model_dir)
    client.force_login(user)
    form = {"mode": "off", "mechanism": "ngram", "k": 5, "shadow_sample_rate": 0.1, "path": "auto",
            "target_path": str(other_model_dir)}  # fmt: skip
    page = client.post(f"/dashboard/endpoints/{endpoint.pk}/policy/", form)
    assert page.status_code == 400
    assert "target_path does not reproduce the endpoint&#x27;s model" in page.content.decode()


def test_top_log_probabilities_alone_can_refuse(api, tiny_model_dir, other_model_dir):
    # given: a reference whose greedy continuation the other checkpoint happens to share (only the canary's
    # prompt positions: no continuation), so the log-probabilities must tell them apart
    endpoint = _endpoint(tiny_model_dir)
    _record(endpoint, served_reference_of(tiny_model_dir, tokens=0))
    response = api.patch(_url(endpoint), {"target_path": str(other_model_dir)}, format="json")
    assert response.status_code == 400
    message = response.json()["target_path"][0]
    assert "top log-probabilities of the probe's canary differ by" in message and "tolerance 0.25 nats" in message


def test_where_the_server_returns_no_log_probabilities_greedy_alone_decides_and_says_so(api, demo_pair):
    # given: a server that cannot score (its reference has the greedy continuation alone)
    endpoint = _endpoint(demo_pair.target_dir, name="demo")
    _record(endpoint, {**served_reference_of(demo_pair.target_dir, top_n=None), "greedy_only": "no scoring"})
    # when / then: the draft's folder is refused on its greedy continuation, and the message says so
    response = api.patch(_url(endpoint), {"target_path": str(demo_pair.draft_dir)}, format="json")
    assert response.status_code == 400
    assert "(the endpoint returns no log-probabilities: greedy alone)" in response.json()["target_path"][0]
    found = target_identity.check(endpoint=endpoint, target_path=str(demo_pair.target_dir))
    assert found.problem == "" and found.note.startswith("greedy continuation alone")


def test_an_endpoint_without_a_recorded_reference_cannot_take_a_target_path(api, tiny_model_dir):
    endpoint = _endpoint(tiny_model_dir)
    Endpoint.objects.filter(pk=endpoint.pk).update(
        capabilities={"tokenizer_fingerprint": endpoint.capabilities["tokenizer_fingerprint"]}
    )
    response = api.patch(_url(endpoint), {"target_path": str(tiny_model_dir)}, format="json")
    assert response.status_code == 400
    assert (
        "cannot check that target_path holds the endpoint's model: no probe has recorded"
        in (response.json()["target_path"][0])
    )


def test_the_verdict_is_kept_until_the_files_change(tiny_model_dir, monkeypatch):
    endpoint = _endpoint(tiny_model_dir)
    runs = []
    real = target_identity._run
    monkeypatch.setattr(target_identity, "_run", lambda *a: runs.append(a) or real(*a))
    # when: checked three times
    for _ in range(3):
        assert target_identity.check(endpoint=endpoint, target_path=str(tiny_model_dir)).problem == ""
    # then: computed once; a weights file with a new modification time is checked again
    assert len(runs) <= 1
    before = len(runs)
    weights = next(tiny_model_dir.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    try:
        assert target_identity.check(endpoint=endpoint, target_path=str(tiny_model_dir)).problem == ""
        assert len(runs) == before + 1
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_process_without_torch_checks_in_a_child_process_with_the_same_verdict(tiny_model_dir, other_model_dir):
    reference = served_reference_of(tiny_model_dir)
    for directory in (tiny_model_dir, other_model_dir):
        here = target_identity._run_here(str(directory), reference)
        child = target_identity._run_in_child(str(directory), reference)
        assert child == here
    assert here["mismatch"] is not None  # the other checkpoint


def test_a_managed_endpoints_own_model_directory_needs_no_reference(tiny_model_dir):
    from fleet.managed.models import ManagedServer

    # given: a managed endpoint not started yet (no probe, no reference) whose server ACE starts from tiny_model_dir
    endpoint = Endpoint.objects.create(name="managed", base_url="http://127.0.0.1:9", kind="vllm")
    ManagedServer.objects.create(endpoint=endpoint, model_dir=str(tiny_model_dir), served_name="m")
    # then: that directory is its model; another is not checked against nothing
    assert target_identity.check(endpoint=endpoint, target_path=str(tiny_model_dir)).problem == ""
    other = target_identity.check(endpoint=endpoint, target_path=str(tiny_model_dir.parent)).problem
    assert other.startswith("cannot check that target_path holds the endpoint's model")
