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


def test_vllm_suffix_flags_size_the_servers_own_store_and_say_what_it_needs(settings):
    settings.SUFFIX_CACHE_REQUESTS = 500
    flags = native_flags(server_kind="vllm", draft_kind="suffix", k=4)

    assert flags.speculative_config == {
        "method": "suffix",
        "num_speculative_tokens": 4,
        "suffix_decoding_max_cached_requests": 500,
        "suffix_decoding_min_token_prob": 0.1,
        "suffix_decoding_max_spec_factor": 2.0,
    }
    assert any("Arctic Inference" in note for note in flags.notes)
    from speculation.engine.suffix import MAX_SPEC_FACTOR, MIN_TOKEN_PROB

    config = flags.speculative_config  # the server cuts and sizes its drafts as ACE does
    assert (config["suffix_decoding_min_token_prob"], config["suffix_decoding_max_spec_factor"]) == (
        MIN_TOKEN_PROB,
        MAX_SPEC_FACTOR,
    )


def test_sglang_has_no_suffix_decoding_and_says_where_it_runs():
    with pytest.raises(NativeFlagsError, match="SGLang has no suffix speculation: run it on ACE's local or remote"):
        native_flags(server_kind="sglang", draft_kind="suffix", k=4)


@pytest.mark.vllm
def test_the_suffix_config_keys_are_fields_of_vllms_own_speculative_config():
    import subprocess

    from ace import processes

    code = (
        "import dataclasses, typing; from vllm.config.speculative import SpeculativeConfig as C; "
        "print(' '.join(f.name for f in dataclasses.fields(C)))"
    )
    fields = subprocess.run(
        [str(processes.vllm_python()), "-c", code], capture_output=True, text=True, timeout=300, check=True
    ).stdout.split()
    config = native_flags(server_kind="vllm", draft_kind="suffix", k=4).speculative_config
    assert set(config) <= set(fields), set(config) - set(fields)


def test_sglang_eagle_head_drafts_a_chain_of_k():
    flags = native_flags(server_kind="sglang", draft_kind="eagle_head", draft_path="/heads/h1", k=5)

    assert flags.args == [
        "--speculative-algorithm", "EAGLE",
        "--speculative-draft-model-path", "/heads/h1",
        "--speculative-num-steps", "5",
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "6",
    ]  # fmt: skip


def test_sglang_eagle_head_with_a_policy_tree_drafts_that_tree():
    tree = {"top_k": 4, "depth": 6, "nodes": 24}
    flags = native_flags(server_kind="sglang", draft_kind="eagle_head", draft_path="/heads/h1", k=5, tree=tree)

    # K caps the depth (as on ACE's own path); the nodes plus the root are verified
    assert flags.args[flags.args.index("--speculative-num-steps") :] == [
        "--speculative-num-steps", "5",
        "--speculative-eagle-topk", "4",
        "--speculative-num-draft-tokens", "25",
    ]  # fmt: skip


def test_sglang_draft_tokens_never_exceed_what_the_capped_steps_expand():
    tree = {"top_k": 2, "depth": 8, "nodes": 12}
    flags = native_flags(server_kind="sglang", draft_kind="eagle_head", draft_path="/h", k=2, tree=tree)

    # 2 steps of top-2 expand at most 2 + 4 = 6 nodes: 7 tokens with the root
    assert flags.args[flags.args.index("--speculative-num-draft-tokens") + 1] == "7"


def test_vllm_has_no_tree_setting_and_says_so():
    tree = {"top_k": 4, "depth": 6, "nodes": 24}
    flags = native_flags(server_kind="vllm", draft_kind="eagle_head", draft_path="/heads/h1", k=5, tree=tree)

    assert flags.speculative_config == {"method": "eagle", "model": "/heads/h1", "num_speculative_tokens": 5}
    assert any("no draft-tree setting" in note for note in flags.notes)


def test_sglang_separate_draft_model_is_standalone():
    flags = native_flags(server_kind="sglang", draft_kind="draft_model", draft_path="/models/d", k=3)

    assert flags.args[:2] == ["--speculative-algorithm", "STANDALONE"]
    assert flags.speculative_config is None


def test_the_command_line_survives_a_shell_round_trip_with_spaces_in_paths():
    flags = native_flags(server_kind="vllm", draft_kind="draft_model", draft_path="/my models/d", k=2)

    assert shlex.split(flags.command_line) == flags.args


DRAFT_AT_D = {"server_kind": "sglang", "draft_kind": "draft_model", "draft_path": "/d"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"server_kind": "openai", "draft_kind": "ngram"}, "no speculative-decoding launch flags"),
        ({"server_kind": "vllm", "draft_kind": "medusa"}, "unknown draft kind"),
        ({"server_kind": "vllm", "draft_kind": "ngram", "k": 0}, "between 1 and 16"),
        ({"server_kind": "sglang", "draft_kind": "ngram", "k": 17}, "between 1 and 16"),
        ({"server_kind": "vllm", "draft_kind": "draft_model"}, "needs the directory"),
        ({"server_kind": "sglang", "draft_kind": "eagle_head", "draft_path": "/h", "tree": {"top_k": 9}}, "top_k"),
        ({**DRAFT_AT_D, "tree": {"top_k": 2, "depth": 3, "nodes": 4}}, "drafted by an EAGLE head"),
        ({"server_kind": "vllm", "draft_kind": "suffix_draft", "draft_path": "/d"}, "runs in ACE's worker"),
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
def test_the_api_gives_a_hybrid_policys_draft_model_flags_and_says_the_hybrid_is_aces(api, endpoint):
    draft = DraftModel.objects.create(name="small", kind="draft_model", path="/drafts/small")
    SpeculationPolicy.objects.create(endpoint=endpoint, mechanism="suffix_draft", draft=draft, k=3)

    body = api.get(f"/api/v1/endpoints/{endpoint.pk}/native-flags/").json()

    assert body["speculative_config"] == {
        "method": "draft_model",
        "model": "/drafts/small",
        "num_speculative_tokens": 3,
    }
    assert any("runs in ACE's worker only" in note and "small alone" in note for note in body["notes"])


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


def test_a_managed_sglang_endpoint_in_prod_is_launched_with_the_policys_tree(db):
    from fleet.managed.services import spec_args, speculation_of

    draft = DraftModel.objects.create(name="head", kind="eagle_head", path="/heads/h1")
    endpoint = Endpoint.objects.create(name="sgl", base_url="http://10.0.0.6:30000", kind="sglang")
    tree = {"top_k": 2, "depth": 4, "nodes": 8}
    policy = SpeculationPolicy(endpoint=endpoint, mode="prod", mechanism="eagle_head", draft=draft, k=5, path="auto",
                               eagle_tree=tree)  # fmt: skip

    speculation = speculation_of(policy)
    args = spec_args(server_kind="sglang", speculation=speculation)

    assert speculation["tree"] == tree
    assert args[args.index("--speculative-eagle-topk") + 1] == "2"
    assert args[args.index("--speculative-num-steps") + 1] == "4"
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "9"
    # a chain policy's launch spec is unchanged (a running chain server is not switched for nothing), and so is a
    # vLLM server's (no tree setting there)
    policy.eagle_tree = {}
    assert "tree" not in speculation_of(policy)
    policy.eagle_tree, policy.endpoint.kind = tree, "vllm"
    assert "tree" not in speculation_of(policy)


def test_a_head_in_the_older_multi_layer_format_has_no_native_flags(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"ace_eagle": {"format": 2, "feature_layers": [1, 3]}}))
    for server_kind in ("vllm", "sglang"):
        with pytest.raises(NativeFlagsError, match="local path only"):
            native_flags(server_kind=server_kind, draft_kind="eagle_head", draft_path=str(tmp_path), k=5)


@pytest.mark.parametrize(
    "config",
    [
        {"architectures": ["LlamaForCausalLMEagle3"], "ace_eagle": {"format": 3, "feature_layers": [1, 3, 4]}},
        {"architectures": ["LlamaForCausalLMEagle3"], "eagle_aux_hidden_state_layer_ids": [2, 16, 29]},  # elsewhere
        {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3"},
    ],
)
def test_an_eagle3_head_runs_as_vllms_eagle3_and_sglangs_eagle3(tmp_path, config):
    # given: an EAGLE-3 head ACE saved, or one trained elsewhere (EAGLE authors' or speculators format)
    (tmp_path / "config.json").write_text(json.dumps(config))
    # when
    vllm = native_flags(server_kind="vllm", draft_kind="eagle_head", draft_path=str(tmp_path), k=4)
    sglang = native_flags(server_kind="sglang", draft_kind="eagle_head", draft_path=str(tmp_path), k=4)
    # then: vLLM's SpeculativeConfig method and SGLang's server_args algorithm for EAGLE-3
    assert vllm.speculative_config == {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 4}
    assert sglang.args[:2] == ["--speculative-algorithm", "EAGLE3"]
    assert sglang.args[sglang.args.index("--speculative-draft-model-path") + 1] == str(tmp_path)
    assert sglang.args[sglang.args.index("--speculative-num-steps") + 1] == "4"
    assert sglang.args[sglang.args.index("--speculative-num-draft-tokens") + 1] == "5"
