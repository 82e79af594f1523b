"""Each draft mechanism is one class, and the facts it owns are the ones the product's paths read."""

from __future__ import annotations

import pytest

from speculation import drafting
from speculation.drafting.mechanisms import (
    EAGLE_NOT_REMOTE,
    HEAD_WEIGHTS,
    MODEL_WEIGHTS,
    SUFFIX_DRAFT_NOT_NATIVE,
    SUFFIX_NOT_MANAGED,
)
from speculation.models import HYBRID_PREFIX, LOOKUP_KINDS, REGISTRABLE_KINDS, DraftKind, DraftModel, Mechanism

LOCAL, REMOTE, NATIVE = "local", "remote", "native"


def test_it_has_exactly_one_class_per_kind():
    assert set(drafting.MECHANISMS) == set(DraftKind.values) == set(Mechanism.values)
    classes = [type(m) for m in drafting.MECHANISMS.values()]
    assert len(set(classes)) == len(classes)
    for kind, mechanism in drafting.MECHANISMS.items():
        assert mechanism.kind == kind
        assert drafting.for_kind(kind) is mechanism


def test_it_refuses_an_unknown_kind_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown draft mechanism 'medusa'.*ngram"):
        drafting.for_kind("medusa")


def test_it_batches_all_but_an_eagle_head():
    assert drafting.BATCHED_KINDS == {"ngram", "suffix", "draft_model", "suffix_draft"}
    assert not drafting.for_kind("eagle_head").batches


def test_it_names_the_lookup_each_mechanism_drafts_with():
    lookups = {kind: m.lookup_kind for kind, m in drafting.MECHANISMS.items()}
    assert lookups == {"ngram": "ngram", "suffix": "suffix", "suffix_draft": "suffix", "draft_model": "",
                       "eagle_head": ""}  # fmt: skip
    assert {kind for kind, m in drafting.MECHANISMS.items() if m.looks_up} == LOOKUP_KINDS


def test_its_sampled_replay_is_exact_for_one_hot_drafts_only():
    exact = {kind for kind, m in drafting.MECHANISMS.items() if m.sampled_exact(None)}
    assert exact == {"ngram", "suffix"}
    assert drafting.for_kind("eagle_head").sampled_exact(object())  # a tree's candidates are one-hot
    assert not drafting.for_kind("suffix_draft").sampled_exact(object())


def test_only_an_eagle_head_reads_the_targets_features():
    assert [k for k, m in drafting.MECHANISMS.items() if m.reads_target_features] == ["eagle_head"]


@pytest.mark.parametrize(
    ("kind", "path", "managed", "problem"),
    [
        ("eagle_head", REMOTE, False, EAGLE_NOT_REMOTE),
        ("eagle_head", LOCAL, False, None),
        ("eagle_head", NATIVE, False, "the server cannot run this head"),
        ("suffix", NATIVE, True, SUFFIX_NOT_MANAGED),
        ("suffix", NATIVE, False, None),
        ("suffix", REMOTE, True, None),
        ("suffix_draft", NATIVE, False, SUFFIX_DRAFT_NOT_NATIVE),
        ("suffix_draft", LOCAL, False, None),
        ("ngram", NATIVE, True, None),
        ("draft_model", NATIVE, True, None),
        ("draft_model", REMOTE, False, None),
    ],
)
def test_it_says_which_paths_each_mechanism_cannot_run_on(kind, path, managed, problem):
    asked = []

    def is_managed() -> bool:
        asked.append(("managed", path))
        return managed

    def head_problem() -> str:
        asked.append(("head", path))
        return "the server cannot run this head"

    mechanism = drafting.for_kind(kind)
    assert mechanism.path_problem(path, managed=is_managed, head_problem=head_problem) == problem
    # each question about the endpoint is asked on path native only, and only by the mechanism it concerns
    assert {where for _, where in asked} <= {NATIVE}
    assert {what for what, _ in asked} <= (
        {"managed"} if kind == "suffix" else {"head"} if kind == "eagle_head" else set()
    )


def test_unasked_questions_never_refuse_a_path():
    for mechanism in drafting.MECHANISMS.values():
        assert mechanism.path_problem(NATIVE) in (None, SUFFIX_DRAFT_NOT_NATIVE)
    assert drafting.for_kind("eagle_head").path_problem(NATIVE, head_problem=lambda: "") is None


def test_it_names_each_mechanisms_native_method_per_server_kind():
    vllm = {kind: m.native_names.get("vllm") for kind, m in drafting.MECHANISMS.items()}
    sglang = {kind: m.native_names.get("sglang") for kind, m in drafting.MECHANISMS.items()}
    assert vllm == {"draft_model": "draft_model", "eagle_head": "eagle", "ngram": "ngram", "suffix": "suffix",
                    "suffix_draft": None}  # fmt: skip
    assert sglang == {"draft_model": "STANDALONE", "eagle_head": "EAGLE", "ngram": "NGRAM", "suffix": None,
                      "suffix_draft": None}  # fmt: skip


def test_reading_the_facts_loads_no_torch():
    import subprocess
    import sys

    code = (
        "import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'ace.settings'); django.setup(); "
        "import sys; from speculation import drafting; drafting.for_kind('ngram').path_problem('native'); "
        "drafting.for_kind('eagle_head').native_name('vllm', ''); assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_only_an_eagle_head_drafts_the_policys_tree():
    assert [k for k in drafting.MECHANISMS if drafting.drafts_trees(k)] == ["eagle_head"]
    assert not drafting.drafts_trees("medusa")


def test_only_the_hybrid_is_run_natively_by_a_stand_in():
    notes = {kind: m.native_stand_in("tiny-draft") for kind, m in drafting.MECHANISMS.items()}
    assert [k for k, note in notes.items() if note] == ["suffix_draft"]
    assert "the draft model tiny-draft alone" in notes["suffix_draft"]


def test_an_eagle3_heads_native_method_is_read_from_its_config(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"ace_eagle": {"format": 3}}))
    eagle = drafting.for_kind("eagle_head")
    assert (eagle.native_name("vllm", ""), eagle.native_name("sglang", "")) == ("eagle", "EAGLE")  # unreadable here
    assert (eagle.native_name("vllm", str(tmp_path)), eagle.native_name("sglang", str(tmp_path))) == (
        "eagle3",
        "EAGLE3",
    )


def test_each_mechanism_picks_its_own_way_of_a_measurement():
    class Ways:
        def lookup(self) -> str:
            return "lookup"

        def draft_model(self) -> str:
            return "draft_model"

        def hybrid(self) -> str:
            return "hybrid"

        def eagle(self) -> str:
            return "eagle"

    ways = {kind: m.measured_by(Ways()) for kind, m in drafting.MECHANISMS.items()}
    assert ways == {"ngram": "lookup", "suffix": "lookup", "draft_model": "draft_model", "suffix_draft": "hybrid",
                    "eagle_head": "eagle"}  # fmt: skip


def test_it_names_the_kind_of_draft_a_policy_of_each_mechanism_names():
    kinds = {kind: m.draft_kind for kind, m in drafting.MECHANISMS.items()}
    assert kinds == {"ngram": "ngram", "suffix": "suffix", "draft_model": "draft_model", "suffix_draft": "draft_model",
                     "eagle_head": "eagle_head"}  # fmt: skip


def test_it_names_each_mechanisms_candidate_and_reads_the_draft_back():
    draft = DraftModel(name="tiny-draft")
    names = {kind: m.candidate_name(draft) for kind, m in drafting.MECHANISMS.items()}
    assert names == {"ngram": "ngram", "suffix": "suffix", "draft_model": "tiny-draft",
                     "suffix_draft": f"{HYBRID_PREFIX}tiny-draft", "eagle_head": "tiny-draft"}  # fmt: skip
    missing = {kind: m.candidate_name(None) for kind, m in drafting.MECHANISMS.items()}
    assert missing == {"ngram": "ngram", "suffix": "suffix", "draft_model": "", "suffix_draft": "", "eagle_head": ""}
    for kind, mechanism in drafting.MECHANISMS.items():
        if not mechanism.looks_up:
            assert mechanism.draft_name(names[kind]) == "tiny-draft"


def test_it_says_what_each_mechanisms_draft_directory_holds():
    weights = {kind: m.weights for kind, m in drafting.MECHANISMS.items()}
    assert weights == {"ngram": "", "suffix": "", "draft_model": MODEL_WEIGHTS, "suffix_draft": MODEL_WEIGHTS,
                       "eagle_head": HEAD_WEIGHTS}  # fmt: skip
    assert {kind for kind, w in weights.items() if not w} == {k for k, m in drafting.MECHANISMS.items() if m.looks_up}


def test_every_mechanism_but_the_hybrid_can_be_registered_as_a_draft():
    registrable = {kind for kind, m in drafting.MECHANISMS.items() if m.registrable}
    assert registrable == {"ngram", "suffix", "draft_model", "eagle_head"}
    assert registrable == {value for value, _ in REGISTRABLE_KINDS}  # the forms' and the API's choices


def test_each_mechanism_drafts_on_an_endpoint_with_its_own_lookup_reading_the_store_only_for_suffix(monkeypatch):
    from speculation.drafting import build
    from speculation.engine import NgramProposer, SuffixIndex, SuffixProposer

    store, read = SuffixIndex(), []
    monkeypatch.setattr(build, "endpoint_index", lambda endpoint_id: read.append(endpoint_id) or store)
    lookups = {kind: m.endpoint_lookup(7, exclude="req-1") for kind, m in drafting.MECHANISMS.items()}
    assert {kind: type(p) for kind, p in lookups.items()} == {"ngram": NgramProposer, "suffix": SuffixProposer,
        "suffix_draft": SuffixProposer, "draft_model": type(None), "eagle_head": type(None)}  # fmt: skip
    assert read == [7, 7]  # suffix decoding and the hybrid read the endpoint's store; n-gram lookup never
    assert all(lookups[k].index is store and lookups[k].exclude == "req-1" for k in ("suffix", "suffix_draft"))
