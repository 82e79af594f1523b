"""Native launch flags: exact vLLM / SGLang flags for a registered draft, and the REST route that serves them."""

from __future__ import annotations

import json
import shlex

import pytest

from fleet.models import Endpoint
from speculation.models import DraftModel, SpeculationPolicy
from speculation.selectors.native_flags import NativeFlagsError, native_flags


def test_vllm_draft_model_flags_are_one_speculative_config_json():
    flags = native_flags(server_kind="vllm", draft_kind="draft_model", draft_path="/models/draft", k=4)

    assert flags.args[0] == "--speculative-config"
    assert json.loads(flags.args[1]) == {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4}
    assert flags.speculative_config == json.loads(flags.args[1])


def test_vllm_eagle_head_uses_method_eagle():
    flags = native_flags(server_kind="vllm", draft_kind="eagle_head", draft_path="/heads/h1", k=5)

    assert json.loads(flags.args[1]) == {"method": "eagle", "model": "/heads/h1", "num_speculative_tokens": 5}


def test_vllm_ngram_flags_carry_the_lookup_window_and_no_model():
    config = native_flags(server_kind="vllm", draft_kind="ngram", k=3).speculative_config

    assert config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_sglang_eagle_head_drafts_a_chain_of_k():
    flags = native_flags(server_kind="sglang", draft_kind="eagle_head", draft_path="/heads/h1", k=5)

    assert flags.args == [
        "--speculative-algorithm", "EAGLE",
        "--speculative-draft-model-path", "/heads/h1",
        "--speculative-num-steps", "5",
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "6",
    ]  # fmt: skip


def test_sglang_separate_draft_model_is_standalone():
    flags = native_flags(server_kind="sglang", draft_kind="draft_model", draft_path="/models/d", k=3)

    assert flags.args[:2] == ["--speculative-algorithm", "STANDALONE"]
    assert flags.speculative_config is None


def test_the_command_line_survives_a_shell_round_trip_with_spaces_in_paths():
    flags = native_flags(server_kind="vllm", draft_kind="draft_model", draft_path="/my models/d", k=2)

    assert shlex.split(flags.command_line) == flags.args


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"server_kind": "openai", "draft_kind": "ngram"}, "no speculative-decoding launch flags"),
        ({"server_kind": "vllm", "draft_kind": "medusa"}, "unknown draft kind"),
        ({"server_kind": "vllm", "draft_kind": "ngram", "k": 0}, "between 1 and 16"),
        ({"server_kind": "sglang", "draft_kind": "ngram", "k": 17}, "between 1 and 16"),
        ({"server_kind": "vllm", "draft_kind": "draft_model"}, "needs the directory"),
    ],
)
def test_impossible_requests_raise_a_clear_error(kwargs, message):
    with pytest.raises(NativeFlagsError, match=message):
        native_flags(**kwargs)


# --- REST -----------------------------------------------------------------------------------------------------


@pytest.fixture
def endpoint(db):
    return Endpoint.objects.create(name="gpu-a", base_url="http://10.0.0.5:8000", kind="vllm")


@pytest.fixture
def head(db):
    return DraftModel.objects.create(name="head-1", kind="eagle_head", path="/heads/h1", target_name="demo")


@pytest.mark.django_db
def test_the_api_returns_flags_for_the_named_draft(api, endpoint, head):
    response = api.get(f"/api/v1/endpoints/{endpoint.pk}/native-flags/?draft={head.pk}&k=4")

    assert response.status_code == 200
    body = response.json()
    assert body["draft"] == "head-1"
    assert body["speculative_config"] == {"method": "eagle", "model": "/heads/h1", "num_speculative_tokens": 4}
    assert shlex.split(body["command_line"]) == body["args"]


@pytest.mark.django_db
def test_the_api_defaults_to_the_policy_draft_and_k(api, endpoint, head):
    SpeculationPolicy.objects.create(endpoint=endpoint, mechanism="eagle_head", draft=head, k=7)

    body = api.get(f"/api/v1/endpoints/{endpoint.pk}/native-flags/").json()

    assert body["k"] == 7
    assert body["speculative_config"]["model"] == "/heads/h1"


@pytest.mark.django_db
def test_the_api_without_policy_or_draft_gives_ngram_flags(api, endpoint):
    body = api.get(f"/api/v1/endpoints/{endpoint.pk}/native-flags/?draft=").json()

    assert body["speculative_config"]["method"] == "ngram"


@pytest.mark.django_db
def test_the_api_refuses_an_openai_endpoint_with_a_400(api, endpoint):
    endpoint.kind = "openai"
    endpoint.save()

    response = api.get(f"/api/v1/endpoints/{endpoint.pk}/native-flags/")

    assert response.status_code == 400
    assert "remote or local verification path" in response.json()["detail"][0]


@pytest.mark.django_db
def test_the_api_404s_an_unknown_draft_and_400s_a_bad_k(api, endpoint):
    assert api.get(f"/api/v1/endpoints/{endpoint.pk}/native-flags/?draft=nope").status_code == 404
    assert api.get(f"/api/v1/endpoints/{endpoint.pk}/native-flags/?k=five").status_code == 400


@pytest.mark.django_db
def test_the_api_needs_authentication(client, endpoint):
    assert client.get(f"/api/v1/endpoints/{endpoint.pk}/native-flags/").status_code in (401, 403)
