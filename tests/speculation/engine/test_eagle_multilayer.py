"""EAGLE-3-style heads: multi-layer target features, training-time test, a versioned head format, exactness.

The head reads [low, mid, high] target features at true positions (fused to one feature) and its own predicted
feature at drafted ones; training unrolls drafting steps with the attention a drafted position has at inference.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from speculation.engine import GenerationConfig, LocalTarget, ModelArgs, Transformer, generate, generate_plain
from speculation.engine import init_weights as init_target
from speculation.engine.eagle import (
    FORMAT_MULTI_LAYER,
    EagleConfig,
    EagleHead,
    EagleHeadError,
    EagleProposer,
    default_feature_layers,
    init_weights,
)
from speculation.engine.tree import TreeShape
from speculation.offline.eagle.train import TrainSettings, train_head, unroll_mask, unrolled
from tests.support.eagle import greedy_sequences

LAYERS = (0, 1)  # a 4-layer target's low and mid layers (default_feature_layers(4))


def tiny_target(seed: int = 0) -> Transformer:
    args = ModelArgs(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=64,
                     max_positions=128)  # fmt: skip
    model = Transformer(args)
    init_target(model, torch.Generator().manual_seed(seed))
    model.output.weight.data *= 30.0  # peaked distributions, like a trained model's
    model.setup_cache()
    return model.eval().requires_grad_(False)


def head_config(layers: tuple[int, ...] = LAYERS) -> EagleConfig:
    return EagleConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=64, max_position_embeddings=128, feature_layers=layers)  # fmt: skip


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_target()


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    """A multi-layer head trained with two unrolled steps; its held-out reports."""
    head = EagleHead(head_config())
    settings = TrainSettings(epochs=5, lr=3e-3, token_weight=1.0, batch_size=4, seed=0, unroll=2)
    train = greedy_sequences(target, 24, seed=1, layers=LAYERS)
    held_out = greedy_sequences(target, 4, seed=2, layers=LAYERS)
    reports = train_head(head, target.tok_embeddings.weight, target.output.weight, train, held_out, settings,
                         work_dir=tmp_path_factory.mktemp("ml-train"))  # fmt: skip
    return head.eval(), reports


def test_the_target_returns_the_named_layers_then_the_final_feature(target):
    tokens = torch.tensor([3, 9, 4, 1, 7])
    with torch.inference_mode():
        plain = target(tokens, 0, return_hidden=True)
        multi = target(tokens, 0, return_hidden=LAYERS)
    assert multi.hidden.shape == (5, 3 * 32)
    assert torch.equal(multi.hidden[:, -32:], plain.hidden)  # the final-norm feature stays last
    assert torch.equal(multi.logits, plain.logits)
    assert not torch.allclose(multi.hidden[:, :32], multi.hidden[:, 32:64])  # two different layers


def test_collected_hf_features_equal_the_engines(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from speculation.engine import load_causal_lm
    from speculation.offline.eagle.collect import features_of

    ids = torch.tensor([[1, 5, 6, 7, 9, 12, 3]])
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    engine = load_causal_lm(tiny_model_dir, max_len=64)
    with torch.inference_mode():
        collected = features_of(hf, ids, (0,))[0]
        ours = engine(ids[0], 0, return_hidden=(0,)).hidden
    assert collected.shape == ours.shape == (7, 2 * 32)
    torch.testing.assert_close(collected, ours, rtol=1e-4, atol=1e-4)


def test_feature_layers_default_to_low_and_mid_and_need_four_layers():
    assert default_feature_layers(8) == (1, 3)
    assert default_feature_layers(32) == (7, 15)
    assert default_feature_layers(2) == ()


def test_the_unrolled_second_step_is_what_the_head_drafts_at_inference(target):
    """Training-time test attends as drafting does: step 2 at root j sees the true pairs up to j and itself."""
    head = EagleHead(head_config())
    init_weights(head, torch.Generator().manual_seed(3))
    data = greedy_sequences(target, 1, seed=5, layers=LAYERS)
    tokens, features = data.tokens[0][None], data.features[0][None]  # [1, T], [1, T, 3H]
    embed = target.tok_embeddings.weight
    with torch.no_grad():
        steps = unrolled(head, embed, tokens, features[:, :-1], 2)
        for j in (0, 4, 11):
            head.setup_cache(64)
            true = head(features[:, : j + 1], F.embedding(tokens[:, 1 : j + 2], embed), 0, use_cache=True)
            g = true[:, -1:]  # the head's feature for position j + 1
            torch.testing.assert_close(steps[0][:, j], g[:, 0], rtol=1e-5, atol=1e-5)
            drafted = head(g, F.embedding(tokens[:, j + 2 : j + 3], embed), j + 1, use_cache=True)
            torch.testing.assert_close(steps[1][:, j], drafted[:, 0], rtol=1e-5, atol=1e-5)


def test_the_unroll_mask_lets_a_draft_see_only_its_roots_past_and_its_own_chain():
    mask, positions = unroll_mask(3, 3, torch.device("cpu"))
    assert positions.tolist() == [0, 1, 2, 1, 2, 3, 2, 3, 4]
    assert mask[7].tolist() == [True, True, False, False, True, False, False, True, False]  # step 3 at root 1


def test_a_multi_layer_head_saves_as_format_2_and_loads_back(tmp_path, trained, target):
    head, _ = trained
    (tmp_path / "t").mkdir()
    head.save(tmp_path / "h")
    meta = json.loads((tmp_path / "h" / "config.json").read_text())["ace_eagle"]
    assert meta["format"] == FORMAT_MULTI_LAYER and meta["feature_layers"] == list(LAYERS)
    loaded = EagleHead.load(tmp_path / "h")
    assert loaded.config.feature_layers == LAYERS
    x = torch.randn(1, 4, 96)
    e = torch.randn(1, 4, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, e), head(x, e))


def test_an_eagle_1_head_still_saves_as_format_1_without_a_fuse_layer(tmp_path):
    head = EagleHead(head_config(()))
    init_weights(head, torch.Generator().manual_seed(0))
    head.save(tmp_path / "h")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["ace_eagle"]["format"] == 1
    assert head.fuse is None and EagleHead.load(tmp_path / "h").fuse is None


def test_a_head_reading_layers_the_target_lacks_is_refused(target):
    head = EagleHead(head_config((0, 7)))
    with pytest.raises(EagleHeadError, match="target layers"):
        EagleProposer(head, target)


def test_training_learns_and_reports_held_out_intervals(trained):
    _, reports = trained
    kept = max(reports, key=lambda r: r.mean_accepted_len)
    assert kept.alpha > 0.2, reports  # an untrained head is accepted far less on this target
    low, high = kept.alpha_interval
    assert low <= kept.alpha <= high


@pytest.mark.parametrize("tree", [None, TreeShape(top_k=2, depth=4, nodes=8)])
def test_greedy_output_with_a_multi_layer_head_is_token_identical_to_plain(target, trained, tree):
    head, _ = trained
    model = LocalTarget(target)
    generator = torch.Generator().manual_seed(11)
    accepted = 0
    for _ in range(4):
        prompt = torch.randint(0, 64, (6,), generator=generator).tolist()
        config = GenerationConfig(max_new_tokens=40, k=4)
        plain = generate_plain(model, prompt, config).tokens
        result = generate(model, EagleProposer(head, target, tree=tree), prompt, config)
        assert result.tokens == plain
        accepted += result.stats.accepted_tokens
    assert accepted > 0  # the head's drafts were used, not only checked
