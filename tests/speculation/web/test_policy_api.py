"""Policy REST API: validation with reasons, change history, mode switches."""

from __future__ import annotations

import pytest

from fleet.models import Endpoint
from speculation.models import DraftModel, PolicyChange, SpeculationPolicy
from speculation.services.drafts import register_draft

pytestmark = pytest.mark.django_db


def _endpoint(*, fingerprint: str = "", status: str = "ready", **caps) -> Endpoint:
    capabilities = {
        "tokenizer_fingerprint": fingerprint,
        "token_id_prompts": True,
        "prompt_scoring_method": "prompt_logprobs",
        "max_context": 1024,
        **caps,
    }
    return Endpoint.objects.create(
        name="ep", base_url="http://127.0.0.1:9", status=status, served_model="m", capabilities=capabilities
    )


def _url(endpoint: Endpoint) -> str:
    return f"/api/v1/endpoints/{endpoint.pk}/policy/"


def test_a_new_endpoint_is_off_by_default(api):
    endpoint = _endpoint()
    response = api.get(_url(endpoint))
    assert response.status_code == 200
    assert response.json()["mode"] == "off"


def test_it_requires_authentication(client):
    endpoint = _endpoint()
    assert client.get(_url(endpoint)).status_code in (401, 403)


def test_prod_with_ngram_on_a_ready_endpoint_is_accepted_and_recorded(api, user):
    endpoint = _endpoint()
    response = api.patch(_url(endpoint), {"mode": "prod", "mechanism": "ngram", "k": 3}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["resolved_path"] == "remote"
    change = PolicyChange.objects.get()
    assert change.changed_by == user
    assert {name: change.changes[name] for name in ("mode", "k", "resolved_path")} == {
        "mode": ["off", "prod"],
        "k": [5, 3],
        "resolved_path": [None, "remote"],  # what auto means, fixed on save (tests/speculation/test_path_choice.py)
    }
    history = api.get(_url(endpoint) + "changes/").json()
    assert history[0]["changed_by"] == "stage-admin"


def test_prod_on_an_endpoint_that_is_not_ready_is_refused_with_the_reason(api):
    endpoint = _endpoint(status="unreachable")
    response = api.patch(_url(endpoint), {"mode": "prod"}, format="json")
    assert response.status_code == 400
    assert "ready endpoint" in response.json()["mode"][0]
    assert not PolicyChange.objects.exists()


def test_a_draft_with_another_tokenizer_is_refused(api, tiny_model_dir):
    endpoint = _endpoint(fingerprint="0" * 64)
    register_draft(name="tiny", kind="draft_model", path=str(tiny_model_dir))
    response = api.patch(_url(endpoint), {"mode": "prod", "mechanism": "draft_model", "draft": "tiny"}, format="json")
    assert response.status_code == 400
    assert "does not match" in response.json()["draft"][0]


def test_a_draft_with_the_endpoints_tokenizer_is_accepted(api, tiny_model_dir):
    draft = register_draft(name="tiny", kind="draft_model", path=str(tiny_model_dir))
    endpoint = _endpoint(fingerprint=draft.tokenizer_fingerprint)
    response = api.patch(_url(endpoint), {"mode": "shadow", "mechanism": "draft_model", "draft": "tiny"}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["draft"] == "tiny"


def test_draft_model_mechanism_without_a_draft_is_refused(api):
    endpoint = _endpoint(fingerprint="a" * 64)
    response = api.patch(_url(endpoint), {"mode": "shadow", "mechanism": "draft_model"}, format="json")
    assert response.status_code == 400
    assert "needs a registered draft" in response.json()["draft"][0]


@pytest.mark.parametrize(("field", "value"), [("k", 0), ("k", 17), ("shadow_sample_rate", 1.5)])
def test_out_of_range_numbers_are_refused(api, field, value):
    endpoint = _endpoint()
    response = api.patch(_url(endpoint), {field: value}, format="json")
    assert response.status_code == 400
    assert field in response.json()


def test_native_path_needs_a_server_that_speculates(api):
    endpoint = _endpoint()
    response = api.patch(_url(endpoint), {"mode": "prod", "path": "native"}, format="json")
    assert response.status_code == 400
    assert "speculates itself" in response.json()["path"][0]


def test_auto_path_is_native_when_the_probe_found_native_speculation(api):
    endpoint = _endpoint(native_speculation=True)
    response = api.patch(_url(endpoint), {"mode": "prod"}, format="json")
    assert response.status_code == 200
    assert response.json()["resolved_path"] == "native"


def test_a_draft_in_use_cannot_be_deleted(api, tiny_model_dir):
    draft = register_draft(name="tiny", kind="draft_model", path=str(tiny_model_dir))
    endpoint = _endpoint(fingerprint=draft.tokenizer_fingerprint)
    api.patch(_url(endpoint), {"mode": "shadow", "mechanism": "draft_model", "draft": "tiny"}, format="json")
    response = api.delete(f"/api/v1/drafts/{draft.pk}/")
    assert response.status_code == 400
    assert DraftModel.objects.filter(pk=draft.pk).exists()


def test_suffix_decoding_needs_no_draft_and_refuses_draft_weights(api, tiny_model_dir):
    draft = register_draft(name="tiny", kind="draft_model", path=str(tiny_model_dir))
    endpoint = _endpoint(fingerprint=draft.tokenizer_fingerprint)
    response = api.patch(_url(endpoint), {"mode": "prod", "mechanism": "suffix", "k": 6}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["mechanism"] == "suffix" and response.json()["resolved_path"] == "remote"
    response = api.patch(_url(endpoint), {"mechanism": "suffix", "draft": "tiny"}, format="json")
    assert response.status_code == 400
    assert response.json()["draft"] == ["mechanism suffix takes no draft weights, but draft 'tiny' is a draft_model"]


def test_suffix_decoding_on_a_managed_servers_native_path_is_refused_with_where_it_runs(api):
    from fleet.managed.models import ManagedServer

    endpoint = _endpoint(native_speculation=True)
    ManagedServer.objects.create(endpoint=endpoint, model_dir="/models/m", served_name="m")
    response = api.patch(_url(endpoint), {"mode": "prod", "mechanism": "suffix", "path": "native"}, format="json")
    assert response.status_code == 400
    assert "Arctic Inference" in response.json()["path"][0] and "path local or remote" in response.json()["path"][0]
    # on the server's own (unmanaged) native path ACE changes nothing on the server: accepted
    ManagedServer.objects.filter(endpoint=endpoint).delete()
    response = api.patch(_url(endpoint), {"mode": "prod", "mechanism": "suffix", "path": "native"}, format="json")
    assert response.status_code == 200, response.json()


def test_suffix_decoding_with_a_draft_fallback_needs_a_draft_model_and_runs_in_aces_worker(api, tiny_model_dir):
    from fleet.managed.models import ManagedServer

    draft = register_draft(name="tiny", kind="draft_model", path=str(tiny_model_dir))
    register_draft(name="lookup", kind="ngram")
    endpoint = _endpoint(fingerprint=draft.tokenizer_fingerprint, native_speculation=True)
    # no draft, or a draft that is no model: refused, saying what it needs
    response = api.patch(_url(endpoint), {"mode": "prod", "mechanism": "suffix_draft"}, format="json")
    assert response.status_code == 400
    assert response.json()["draft"] == ["mechanism suffix_draft needs a registered draft"]
    body = {"mode": "prod", "mechanism": "suffix_draft", "draft": "lookup"}
    response = api.patch(_url(endpoint), body, format="json")
    assert response.status_code == 400
    assert response.json()["draft"] == ["draft 'lookup' is a ngram, not a draft_model"]
    # the server's native path cannot run it (one method per server): refused; auto goes to ACE's remote path
    body = {"mode": "prod", "mechanism": "suffix_draft", "draft": "tiny", "path": "native"}
    response = api.patch(_url(endpoint), body, format="json")
    assert response.status_code == 400
    assert "ACE's worker (path local or remote)" in response.json()["path"][0]
    response = api.patch(_url(endpoint), {**body, "path": "auto"}, format="json")
    assert response.status_code == 200, response.json()
    assert (response.json()["mechanism"], response.json()["draft"]) == ("suffix_draft", "tiny")
    assert response.json()["resolved_path"] == "remote"
    # a managed server is never switched to run it natively
    ManagedServer.objects.create(endpoint=endpoint, model_dir="/models/m", served_name="m")
    response = api.patch(_url(endpoint), {"path": "native"}, format="json")
    assert response.status_code == 400
    assert "ACE's worker" in response.json()["path"][0]
    assert SpeculationPolicy.objects.get(endpoint=endpoint).path == "auto"  # nothing half-saved
