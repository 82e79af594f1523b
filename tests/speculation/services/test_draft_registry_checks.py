"""A draft's kind is what its folder holds, its sizes are bounded, and its name is unique in any letter case.

Why: a plain model registered as `eagle_head` makes prod fall back on every request, a `vocab_size` of 10**12 sizes
buffers and overflows the database's integer column, and `DEMO-DRAFT` beside `demo-draft` reads as one draft.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from django.db import IntegrityError, transaction

from speculation.models import DraftModel

pytestmark = pytest.mark.django_db

DRAFTS = "/api/v1/drafts/"


def _copy(tiny_model_dir: Path, tmp_path: Path, name: str, **config_changes) -> Path:
    folder = tmp_path / name
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


def test_a_plain_model_registered_as_an_eagle_head_is_refused(api, tiny_model_dir):
    response = api.post(DRAFTS, {"name": "h", "kind": "eagle_head", "path": str(tiny_model_dir)}, format="json")

    assert response.status_code == 400
    message = response.json()["path"][0]
    assert "not an EAGLE head" in message and "draft_model" in message
    assert not DraftModel.objects.exists()


def test_an_eagle_head_registered_as_a_draft_model_is_refused(api, tiny_model_dir, tmp_path):
    head = _copy(tiny_model_dir, tmp_path, "head", ace_eagle={"format": 1, "hidden_size": 32})

    wrong = api.post(DRAFTS, {"name": "d", "kind": "draft_model", "path": str(head)}, format="json")
    right = api.post(DRAFTS, {"name": "h", "kind": "eagle_head", "path": str(head)}, format="json")

    assert wrong.status_code == 400
    assert "an EAGLE head" in wrong.json()["path"][0] and "eagle_head" in wrong.json()["path"][0]
    assert right.status_code == 201, right.content


def test_an_eagle3_head_trained_elsewhere_registers_as_an_eagle_head(api, tiny_model_dir, tmp_path):
    # given: the published EAGLE-3 heads' config (no ace_eagle section), beside the target's tokenizer
    eagle3 = {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "draft_vocab_size": 32,
              "eagle_aux_hidden_state_layer_ids": [1, 2]}  # fmt: skip
    head = _copy(tiny_model_dir, tmp_path, "published", **eagle3)
    odd = _copy(tiny_model_dir, tmp_path, "odd", **eagle3, fc_norm=True)
    # when
    right = api.post(DRAFTS, {"name": "e3", "kind": "eagle_head", "path": str(head)}, format="json")
    wrong = api.post(DRAFTS, {"name": "e3-model", "kind": "draft_model", "path": str(head)}, format="json")
    refused = api.post(DRAFTS, {"name": "odd", "kind": "eagle_head", "path": str(odd)}, format="json")
    # then: an EAGLE head; a variant ACE's engine cannot replay is a 400 naming it
    assert right.status_code == 201, right.content
    assert wrong.status_code == 400 and "an EAGLE head" in wrong.json()["path"][0]
    assert refused.status_code == 400 and "fc_norm" in refused.json()["path"][0]
    assert list(DraftModel.objects.values_list("name", flat=True)) == ["e3"]


@pytest.mark.parametrize(
    ("key", "value"),
    [("vocab_size", 10**12), ("hidden_size", 10**9), ("num_hidden_layers", 100_000), ("intermediate_size", 10**10)],
)
def test_a_config_with_an_impossible_size_is_a_400_naming_the_bound(api, tiny_model_dir, tmp_path, key, value):
    folder = _copy(tiny_model_dir, tmp_path, "huge", **{key: value})

    response = api.post(DRAFTS, {"name": "huge", "kind": "draft_model", "path": str(folder)}, format="json")

    assert response.status_code == 400
    message = response.json()["path"][0]
    assert key in message and "at most" in message
    assert not DraftModel.objects.exists()


def test_draft_names_are_unique_in_any_letter_case(api):
    first = api.post(DRAFTS, {"name": "demo-draft", "kind": "ngram"}, format="json")
    second = api.post(DRAFTS, {"name": "DEMO-DRAFT", "kind": "ngram"}, format="json")

    assert first.status_code == 201
    assert second.status_code == 400
    assert "already exists" in second.json()["name"][0]
    assert DraftModel.objects.count() == 1


def test_the_database_refuses_a_draft_name_differing_only_in_case():
    DraftModel.objects.create(name="demo-draft", kind="ngram")

    with pytest.raises(IntegrityError), transaction.atomic():
        DraftModel.objects.create(name="Demo-Draft", kind="ngram")


def test_the_migration_renames_drafts_differing_only_in_case_keeping_the_oldest():
    # given drafts registered before names were unique in any case (the database refuses them now: plain objects)
    import importlib
    from types import SimpleNamespace

    migration = importlib.import_module("speculation.migrations.0017_draft_and_run_ownership")
    saved = []
    rows = [SimpleNamespace(pk=pk, name=name) for pk, name in ((1, "demo-draft"), (2, "other"), (3, "DEMO-DRAFT"))]
    for row in rows:
        row.save = lambda update_fields, row=row: saved.append((row.pk, row.name, update_fields))
    model = SimpleNamespace(objects=SimpleNamespace(order_by=lambda field: sorted(rows, key=lambda r: r.pk)))

    # when the migration's data step runs
    migration.rename_case_duplicates(SimpleNamespace(get_model=lambda app, name: model), None)

    # then the oldest keeps its name, the later one gets its id
    assert [r.name for r in rows] == ["demo-draft", "other", "DEMO-DRAFT-3"]
    assert saved == [(3, "DEMO-DRAFT-3", ["name"])]


def test_a_draft_of_a_family_transformers_runs_registers_as_generic_and_says_so(
    api, client, user, tiny_model_dir, tmp_path
):
    # given a draft whose config.json is a GPT-NeoX (Pythia) model's: no family of ACE's own layer
    folder = _copy(tiny_model_dir, tmp_path, "pythia", model_type="gpt_neox")

    # when registered, then: accepted, and the answer and the draft page say it runs through transformers
    generic = api.post(DRAFTS, {"name": "pythia", "kind": "draft_model", "path": str(folder)}, format="json")
    native = api.post(DRAFTS, {"name": "llama", "kind": "draft_model", "path": str(tiny_model_dir)}, format="json")
    ngram = api.post(DRAFTS, {"name": "lookup", "kind": "ngram"}, format="json")

    assert generic.status_code == 201, generic.content
    assert generic.json()["implementation"] == "generic"
    assert native.json()["implementation"] == "native"
    assert ngram.json()["implementation"] is None
    assert api.get(f"{DRAFTS}{generic.json()['id']}/").json()["implementation"] == "generic"
    client.force_login(user)
    page = client.get("/dashboard/drafts/").content.decode()
    assert page.count('data-implementation="generic"') == 1


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"model_type": "mixtral", "num_local_experts": 8}, "mixture-of-experts models are not supported"),
        ({"model_type": "deepseek_v3", "n_routed_experts": 64}, "mixture-of-experts models are not supported"),
        ({"model_type": "bart", "is_encoder_decoder": True}, "encoder-decoder models are not supported"),
        ({"model_type": "llava", "text_config": {}, "vision_config": {}}, "multimodal models are not supported"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantized checkpoints are not supported"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config: fp8"),
        ({"model_type": "mamba"}, "recurrent or hybrid models are not supported"),
    ],
)
def test_a_draft_the_engine_cannot_run_exactly_is_a_400_naming_the_reason(
    api, tiny_model_dir, tmp_path, changes, reason
):
    folder = _copy(tiny_model_dir, tmp_path, "refused", **changes)

    response = api.post(DRAFTS, {"name": "refused", "kind": "draft_model", "path": str(folder)}, format="json")

    assert response.status_code == 400
    assert reason in response.json()["path"][0]
    assert not DraftModel.objects.exists()
