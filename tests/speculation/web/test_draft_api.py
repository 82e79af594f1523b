"""Draft registry REST API: facts read from the directory, clear 400s."""

from __future__ import annotations

import pytest

from fleet.probing import CANARY_TEXT, fingerprint_token_ids

pytestmark = pytest.mark.django_db


def test_registering_a_draft_reads_its_facts_from_the_directory(api, tiny_model_dir):
    from transformers import AutoTokenizer

    response = api.post(
        "/api/v1/drafts/", {"name": "tiny", "kind": "draft_model", "path": str(tiny_model_dir)}, format="json"
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["vocab_size"] == 300
    assert body["param_count"] > 0
    assert body["vram_bytes"] >= body["param_count"] * 4  # float32 weights
    ids = AutoTokenizer.from_pretrained(str(tiny_model_dir))(CANARY_TEXT, add_special_tokens=True)["input_ids"]
    assert body["tokenizer_fingerprint"] == fingerprint_token_ids(ids)


def test_a_missing_directory_is_a_400_that_says_so(api, tmp_path):
    response = api.post(
        "/api/v1/drafts/", {"name": "x", "kind": "draft_model", "path": str(tmp_path / "nope")}, format="json"
    )
    assert response.status_code == 400
    assert "not a directory" in response.json()["path"][0]


def test_an_ngram_draft_needs_no_weights(api):
    response = api.post("/api/v1/drafts/", {"name": "ngram", "kind": "ngram"}, format="json")
    assert response.status_code == 201
    assert api.get("/api/v1/drafts/").json()["results"][0]["name"] == "ngram"


def test_a_duplicate_name_is_refused(api):
    api.post("/api/v1/drafts/", {"name": "ngram", "kind": "ngram"}, format="json")
    response = api.post("/api/v1/drafts/", {"name": "ngram", "kind": "ngram"}, format="json")
    assert response.status_code == 400
    assert "already exists" in response.json()["name"][0]


def test_the_hybrid_is_no_kind_of_draft_and_registering_one_says_what_to_do(api, tiny_model_dir):
    from django.core.exceptions import ValidationError

    from speculation.models import DraftModel
    from speculation.services.drafts import register_draft

    body = {"name": "h", "kind": "suffix_draft", "path": str(tiny_model_dir)}
    response = api.post("/api/v1/drafts/", body, format="json")
    assert response.status_code == 400 and "kind" in response.json()
    with pytest.raises(ValidationError, match="a policy's mechanism, not a kind of draft"):
        register_draft(name="h", kind="suffix_draft", path=str(tiny_model_dir))
    assert not DraftModel.objects.filter(name="h").exists()
