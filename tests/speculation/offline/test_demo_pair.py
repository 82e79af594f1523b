"""The demo pair: a servable Llama target and a distilled draft, cached and built atomically."""

from __future__ import annotations

import json

import pytest

from speculation.offline.demo import build as demo_build
from speculation.offline.demo import ensure_demo_pair
from speculation.offline.demo.corpus import stdlib_corpus
from speculation.offline.demo.shipped import SHIPPED_DIR as SHIPPED_MODELS
from speculation.offline.demo.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def pair():
    return ensure_demo_pair()


@pytest.fixture(autouse=True)
def nothing_shipped(tmp_path_factory, monkeypatch):
    """The cache and build rules below, as on a clone without shipped models (``test_shipped_models.py``)."""
    from speculation.offline.demo import shipped

    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path_factory.mktemp("nothing-shipped"))


def test_target_and_draft_are_llama_checkpoints_with_one_vocabulary(pair):
    configs = {
        name: json.loads((d / "config.json").read_text())
        for name, d in (("target", pair.target_dir), ("draft", pair.draft_dir))
    }
    for config in configs.values():
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert config["max_position_embeddings"] >= 1024
        assert config["dtype"] == "float32"
    assert configs["target"]["vocab_size"] == configs["draft"]["vocab_size"]
    assert configs["target"]["num_hidden_layers"] >= 8 > configs["draft"]["num_hidden_layers"]
    for directory in (pair.target_dir, pair.draft_dir):
        for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (directory / name).is_file(), directory / name


def test_transformers_loads_the_tokenizer_with_bos_eos_and_a_chat_template(pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair.target_dir)
    ids = tokenizer("def f(x):\n    return x").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x"
    assert tokenizer.eos_token == "</s>"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|assistant|>\n")


def test_the_draft_agrees_with_the_target_on_held_out_text(pair):
    info = pair.build_info
    if "draft-code" in pair.extra_drafts:  # "draft" distilled on English only, "draft-code" on code only
        # what speculation meets is the target's own text (generated: 0.78 / 0.85 on demo-v10); teacher forced on
        # held-out human text a memorising target (v9, v10) is itself unsure, and agreement there is lower (0.44 /
        # 0.50 on demo-v10, 0.38-0.40 on v9; docs/BENCHMARKS.md); the floors leave room for a rebuild on another CPU
        assert info["alpha_heldout_text_prose"] >= 0.35 and info["alpha_heldout_generated_prose"] >= 0.7
        assert info["alpha_heldout_text_draft_code"] >= 0.35 and info["alpha_heldout_generated_draft_code"] >= 0.7
    else:
        assert info["alpha_heldout_text"] >= 0.6
        assert info["alpha_heldout_generated"] >= 0.6
    if "draft-prose" in pair.extra_drafts:  # distilled on English paragraphs only: ahead of the main draft there
        # (that it loses on code is shown by speculating, test_demo_quality: teacher forced on held-out code, its
        # twice longer distillation keeps it level with the main draft, docs/BENCHMARKS.md)
        assert info["alpha_heldout_text_paragraphs_draft_prose"] >= 0.6
        assert info["alpha_heldout_generated_paragraphs_draft_prose"] >= 0.6
        assert info["alpha_heldout_text_paragraphs_draft_prose"] > info["alpha_heldout_text_paragraphs"]
    assert info["target_params"] >= 4 * info["draft_params"]


@pytest.mark.slow
def test_the_builder_reproduces_the_shipped_pairs_quality(tmp_path):
    """The shipped pair (models/) is what the builder makes: a fresh build (about 12 min on this 2-core CPU) agrees
    with its draft as the shipped build's figures say, within 0.05 of each (a build on another CPU may round
    differently; the figures are acceptance rates over thousands of held-out tokens)."""
    shipped_info = json.loads((SHIPPED_MODELS / demo_build.DEFAULT_DEMO_VERSION / "build_info.json").read_text())
    fresh = demo_build.build_demo_pair(tmp_path / "built", name=demo_build.DEFAULT_DEMO_VERSION)
    alphas = [key for key in shipped_info if key.startswith("alpha_")]
    assert alphas
    for key in alphas:
        assert abs(fresh[key] - shipped_info[key]) <= 0.05, (key, fresh[key], shipped_info[key])
    assert fresh["target_params"] == shipped_info["target_params"]


def test_engine_greedy_speculation_on_the_demo_pair_equals_plain_greedy(pair):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine stalls torch's thread barrier
    try:
        _check_greedy_identity(pair)
    finally:
        torch.set_num_threads(threads)


def _check_greedy_identity(pair) -> None:
    from tokenizers import Tokenizer

    from speculation.engine import DraftModelProposer, GenerationConfig, LocalTarget, generate, load_causal_lm

    tokenizer = Tokenizer.from_file(str(pair.target_dir / "tokenizer.json"))
    target = LocalTarget(load_causal_lm(pair.target_dir, max_len=512))
    draft = load_causal_lm(pair.draft_dir, max_len=512)
    config = GenerationConfig(max_new_tokens=40, k=5)
    for text in ("import os\n\n\ndef main(argv):\n", "class Parser:\n    def __init__(self, text):\n"):
        prompt = tokenizer.encode(text).ids
        plain = generate(target, None, prompt, config)
        spec = generate(target, DraftModelProposer(draft, target_vocab_size=target.vocab_size), prompt, config)
        assert spec.tokens == plain.tokens
        assert spec.stats.target_passes < plain.stats.target_passes


def _cached(root, version: str) -> None:
    """A cached pair's directory with every draft of the version's recipe."""
    for label in demo_build.recipe_drafts(demo_build.RECIPES[version]):
        (root / version / label).mkdir(parents=True)


def _must_not_build(monkeypatch) -> None:
    monkeypatch.setattr(demo_build, "build_demo_pair", lambda out, name=None: pytest.fail("must not rebuild"))
    monkeypatch.setattr(demo_build, "_add_drafts", lambda *args: pytest.fail("must not add drafts"))


@pytest.mark.parametrize("version", sorted(demo_build.RECIPES))
def test_a_cached_pair_is_returned_without_building(tmp_path, monkeypatch, version):
    _cached(tmp_path, version)
    _must_not_build(monkeypatch)
    assert ensure_demo_pair(models_dir=tmp_path, version=version).root == tmp_path / version


def test_the_default_pair_is_the_demo_version(tmp_path, monkeypatch):
    _cached(tmp_path, demo_build.DEMO_VERSION)
    _must_not_build(monkeypatch)
    assert ensure_demo_pair(models_dir=tmp_path).root.name == demo_build.DEMO_VERSION
    assert demo_build.DEMO_VERSION in demo_build.RECIPES


@pytest.mark.parametrize("version", sorted(demo_build.RECIPES))
def test_a_crashed_build_leaves_nothing_that_could_be_used(tmp_path, monkeypatch, version):
    (tmp_path / f".{version}.tmp-1").mkdir()  # debris of an earlier crash
    built = []

    def crash(out, name=None):
        built.append(name)
        (out / "target").mkdir()
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(demo_build, "build_demo_pair", crash)
    with pytest.raises(RuntimeError, match="mid-build"):
        ensure_demo_pair(models_dir=tmp_path, version=version)
    assert built == [version]  # the recipe of the version asked for
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{version}.lock"]


def test_a_cached_pair_built_before_its_recipe_had_a_draft_gets_only_that_draft_once(tmp_path, monkeypatch):
    # given: demo-v3 cached with its target and main draft, built before the recipe had draft-prose
    for label in ("target", "draft"):
        (tmp_path / "demo-v3" / label).mkdir(parents=True)
    added = []

    def distil(root, recipe, labels):
        added.append(labels)
        for label in labels:
            (root / label).mkdir()

    monkeypatch.setattr(demo_build, "build_demo_pair", lambda out, name=None: pytest.fail("must not rebuild"))
    monkeypatch.setattr(demo_build, "_add_drafts", distil)
    # when: the pair is asked for twice
    first = ensure_demo_pair(models_dir=tmp_path, version="demo-v3")
    second = ensure_demo_pair(models_dir=tmp_path, version="demo-v3")
    # then: the missing draft was added once, and both see it
    assert added == [["draft-prose"]]
    assert list(first.extra_drafts) == list(second.extra_drafts) == ["draft-prose"]


def _tiny_recipe():
    from speculation.offline.demo.recipes import Recipe
    from speculation.offline.demo.train import ModelShape, TrainPlan

    plan = TrainPlan(seq_len=32, target_steps=2, draft_steps=3, teacher_real=2, gen_prompts=2, gen_new_tokens=8)
    return Recipe(
        plan=plan,
        target_shape=ModelShape(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64),
        draft_shape=ModelShape(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32),
        tokenizer_bytes=60_000,
        train_bytes=60_000,
        held_out_bytes=30_000,
        prose_bytes=30_000,
        prose_draft=plan,
    )


def test_a_draft_added_to_a_cached_pair_is_the_draft_a_fresh_build_makes(tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import load_file

    # given: a fresh build of a tiny recipe with a prose draft, and a copy of it without that draft
    monkeypatch.setitem(demo_build.RECIPES, "demo-tiny", _tiny_recipe())
    fresh = tmp_path / "fresh"
    fresh_info = demo_build.build_demo_pair(fresh, name="demo-tiny")
    cached = tmp_path / "models" / "demo-tiny"
    shutil.copytree(fresh, cached, ignore=shutil.ignore_patterns("draft-prose"))
    prose_keys = [key for key in fresh_info if key.endswith("_draft_prose")]
    old_info = {key: value for key, value in fresh_info.items() if key not in prose_keys}
    (cached / "build_info.json").write_text(json.dumps(old_info))
    target_before = (cached / "target" / "model.safetensors").read_bytes()
    # when: the cached pair is asked for
    pair = ensure_demo_pair(models_dir=tmp_path / "models", version="demo-tiny")
    # then: it has the draft, with the fresh build's weights and figures; the target is untouched
    assert list(pair.extra_drafts) == ["draft-prose"]
    added, built = (
        load_file(cached / "draft-prose" / "model.safetensors"),
        load_file(fresh / "draft-prose" / "model.safetensors"),
    )
    assert added.keys() == built.keys() and all(added[name].equal(built[name]) for name in built)
    assert (cached / "target" / "model.safetensors").read_bytes() == target_before
    info = pair.build_info
    assert prose_keys and {key: info[key] for key in prose_keys} == {key: fresh_info[key] for key in prose_keys}
    assert list(info["drafts_added"]) == ["draft-prose"]
    assert not [p.name for p in cached.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_drafts_lists_the_main_draft_first_and_the_extra_drafts_on_disk(tmp_path):
    root = tmp_path / "demo-vX"
    pair = demo_build.DemoPair(root=root, target_dir=root / "target", draft_dir=root / "draft")
    assert pair.drafts == {"draft": root / "draft"}
    assert pair.extra_drafts == {}
    (root / "draft-code").mkdir(parents=True)
    assert list(pair.drafts.items()) == [("draft", root / "draft"), ("draft-code", root / "draft-code")]
    assert pair.extra_drafts == {"draft-code": root / "draft-code"}


@pytest.mark.parametrize("value", ["demo-v5", ""])
def test_ace_demo_version_overrides_the_default_version(value):
    import os
    import subprocess
    import sys

    code = "from speculation.offline.demo import DEMO_VERSION; print(DEMO_VERSION)"
    env = {**os.environ, "ACE_DEMO_VERSION": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == (value or demo_build.DEFAULT_DEMO_VERSION)


def test_an_unknown_version_is_refused_before_anything_is_built(tmp_path):
    with pytest.raises(ValueError, match="demo-v0"):
        ensure_demo_pair(models_dir=tmp_path, version="demo-v0")
    assert list(tmp_path.iterdir()) == []


def test_the_english_text_is_fixed_prose_apart_from_the_held_out_files():
    corpus = stdlib_corpus()
    first, second = corpus.english_text(300_000), corpus.english_text(300_000)
    assert first == second
    assert 250_000 <= len(first.encode("utf-8")) and len(first) <= 300_000
    assert "def " not in first[:2000]  # docstrings, not code
    held = corpus.english_text(50_000, held_out=True)
    assert held and held[:500] not in first


def test_the_corpus_split_is_fixed_and_disjoint():
    first, second = stdlib_corpus(), stdlib_corpus()
    assert first == second
    assert not set(first.train_files) & set(first.held_out_files)
    assert len(first.held_out_files) * 8 < len(first.train_files)


def test_tokenizer_training_is_deterministic():
    text = stdlib_corpus().train_text(200_000)
    a, b = train_tokenizer(text, vocab_size=400), train_tokenizer(text, vocab_size=400)
    assert a.to_str() == b.to_str()


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_mixed_training_batches_take_rows_from_both_streams_by_share(share):
    import torch

    from speculation.offline.demo.train import TrainPlan, _mixed_windows

    code, prose = torch.arange(0, 1000), torch.arange(5000, 6000)
    plan = TrainPlan(seq_len=16, target_batch=64, prose_share=share)
    batch = _mixed_windows(code, prose, plan, torch.Generator().manual_seed(0))
    assert batch.shape == (64, 16)
    prose_rows = int((batch[:, 0] >= 5000).sum())
    assert ((batch >= 5000).all(1) | (batch < 1000).all(1)).all()  # a row never straddles the streams
    assert abs(prose_rows - 64 * share) <= 16  # binomial(64, 0.5): sd 4, so 4 sd of tolerance


def test_unlikelihood_penalises_probability_on_tokens_already_in_the_window():
    import torch

    from speculation.offline.demo.train import unlikelihood_loss

    batch = torch.tensor([[1, 2, 3, 4]])  # positions predict 2, 3, 4; tokens seen so far: {1}, {1,2}, {1,2,3}
    on_seen, on_unseen = torch.zeros(1, 4, 8), torch.zeros(1, 4, 8)
    on_seen[..., 1] = 8.0  # most mass on token 1, already in every window
    on_unseen[..., 7] = 8.0  # the same mass on token 7, never seen
    assert unlikelihood_loss(on_seen, batch) > 10 * unlikelihood_loss(on_unseen, batch)
    assert unlikelihood_loss(on_unseen, batch) > 0  # the little mass left on seen tokens still counts


def test_unwrapped_paragraphs_join_hard_wrapped_lines_and_keep_paragraph_breaks():
    from speculation.offline.demo.corpus import unwrap_paragraphs

    text = "Return the number of\n    items in the list.\n\n\n\nRaises ValueError\nwhen empty.\n\n   \n"
    assert unwrap_paragraphs(text) == ["Return the number of items in the list.", "Raises ValueError when empty."]
