"""EAGLE-3 heads in vLLM's layout: the checkpoint vLLM and SGLang load, vLLM's forward, exact drafting, training.

The real vLLM drafting with such a head: tests/speculation/selectors/test_native_flags_vllm.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from speculation.engine import GenerationConfig, LocalTarget, ModelArgs, Transformer, generate, generate_plain
from speculation.engine import init_weights as init_target
from speculation.engine.eagle import EagleConfig, EagleHead, EagleHeadError, EagleProposer, init_weights, make_head
from speculation.engine.eagle3 import Eagle3Head
from speculation.engine.eagle_format import FORMAT_EAGLE3, head_format
from speculation.engine.tree import TreeShape
from speculation.offline.eagle.train import TrainSettings, train_head
from tests.support.eagle import greedy_sequences

H, V, TAPS = 32, 64, (0, 1, 2)  # a 5-layer target tapped after layers 0, 1, 2: vLLM's aux ids 1, 2, 3


def tiny_target(seed: int = 0) -> Transformer:
    args = ModelArgs(vocab_size=V, dim=H, n_layers=5, n_heads=4, n_kv_heads=2, intermediate_size=64,
                     max_positions=128)  # fmt: skip
    model = Transformer(args)
    init_target(model, torch.Generator().manual_seed(seed))
    model.output.weight.data *= 30.0  # peaked distributions, like a trained model's
    model.setup_cache()
    return model.eval().requires_grad_(False)


def eagle3_config(**overrides) -> EagleConfig:
    return EagleConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=V, max_position_embeddings=128, feature_layers=TAPS, eagle3=True,
                       **overrides)  # fmt: skip


def seeded_head(seed: int = 0, **overrides) -> Eagle3Head:
    head = make_head(eagle3_config(**overrides))
    init_weights(head, torch.Generator().manual_seed(seed))
    with torch.no_grad():  # norms away from 1, so that a wrong norm shows
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.3)
    return head.eval()


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_target()


def vllm_reference(tensors: dict, aux: torch.Tensor, embeds: torch.Tensor, lm_head: torch.Tensor, eps: float):
    """vLLM 0.32's llama_eagle3 forward over one sequence written from its source, on the checkpoint's tensors
    (no cache, causal): combine_hidden_states (fc), the layer (input_layernorm on the embeddings, hidden_norm on
    the feature, the residual un-normed: norm_before_residual false), the final norm, compute_logits."""

    def rms(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def rope(x, positions):
        d = x.shape[-1]
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(positions.float(), inv)
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
        rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos[:, None] + rotated * sin[:, None]

    m = "midlayer."
    t = aux.shape[0]
    hidden = aux @ tensors["fc.weight"].T  # [T, H]
    residual = hidden
    x = torch.cat([rms(embeds, tensors[m + "input_layernorm.weight"]), rms(hidden, tensors[m + "hidden_norm.weight"])],
                  -1)  # fmt: skip
    q = (x @ tensors[m + "self_attn.q_proj.weight"].T).view(t, 4, 8)
    k = (x @ tensors[m + "self_attn.k_proj.weight"].T).view(t, 2, 8)
    v = (x @ tensors[m + "self_attn.v_proj.weight"].T).view(t, 2, 8)
    positions = torch.arange(t)
    q, k = rope(q, positions), rope(k, positions)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / 8**0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, 32) @ tensors[m + "self_attn.o_proj.weight"].T
    residual = residual + attn
    h = rms(residual, tensors[m + "post_attention_layernorm.weight"])
    mlp = (F.silu(h @ tensors[m + "mlp.gate_proj.weight"].T) * (h @ tensors[m + "mlp.up_proj.weight"].T)) @ tensors[
        m + "mlp.down_proj.weight"
    ].T
    prenorm = residual + mlp
    return prenorm, rms(prenorm, tensors["norm.weight"]) @ lm_head.T


def test_it_saves_the_checkpoint_vllm_and_sglang_load(tmp_path):
    # given
    head = seeded_head()
    # when
    head.save(tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    tensors = load_file(tmp_path / "h" / "model.safetensors")
    # then: vLLM's Eagle3LlamaForCausalLM reads these keys and names (fc: 3H -> H; q/k/v read [embedding, feature])
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: the inputs of layers 1, 2, 3
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: the outputs of 0, 1, 2
    assert "draft_vocab_size" not in config and config["target_hidden_size"] == H  # SGLang: the target's LM head
    assert config["norm_before_residual"] is False and head_format(config) == FORMAT_EAGLE3
    assert tensors["fc.weight"].shape == (H, 3 * H)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 2 * H)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (16, 2 * H)
    assert {"midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "norm.weight"} <= set(tensors)
    assert not any(name.startswith(("embed_tokens", "lm_head", "d2t")) for name in tensors)  # the target's


def test_it_loads_back_and_drafts_the_same(tmp_path):
    head = seeded_head()
    head.save(tmp_path / "h")
    loaded = EagleHead.load(tmp_path / "h")
    assert isinstance(loaded, Eagle3Head) and loaded.config == head.config
    x, e = torch.randn(1, 5, 4 * H), torch.randn(1, 5, H)
    with torch.no_grad():
        assert torch.equal(loaded(x, e), head(x, e))


def test_its_forward_is_vllms_eagle3_forward(tmp_path, target):
    # given: a head's checkpoint and the target's features of one sequence
    head = seeded_head(3)
    head.save(tmp_path / "h")
    tensors = load_file(tmp_path / "h" / "model.safetensors")
    tokens = torch.tensor([5, 9, 2, 33, 7, 1, 60, 12])
    with torch.no_grad():
        features = target(tokens, 0, return_hidden=TAPS).hidden  # [T, 4H]: three aux states and the final feature
        embeds = F.embedding(tokens, target.tok_embeddings.weight)
        # when
        ours = head(features[None], embeds[None])[0]
        logits = head.logits(ours, target.output.weight)
        reference, reference_logits = vllm_reference(tensors, features[:, : 3 * H], embeds, target.output.weight, 1e-5)
    # then
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)


def test_norm_before_residual_makes_the_residual_the_normed_feature():
    plain, before = seeded_head(1), seeded_head(1, norm_before_residual=True)
    x, e = torch.randn(1, 3, 4 * H), torch.randn(1, 3, H)
    with torch.no_grad():
        assert not torch.allclose(plain(x, e), before(x, e))


@pytest.mark.parametrize("tree", [None, TreeShape(top_k=2, depth=3, nodes=6)])
def test_greedy_output_with_an_eagle3_head_is_token_identical_to_plain(target, tree):
    head = seeded_head(2)
    model = LocalTarget(target)
    generator = torch.Generator().manual_seed(7)
    for _ in range(3):
        prompt = torch.randint(0, V, (6,), generator=generator).tolist()
        config = GenerationConfig(max_new_tokens=30, k=3)
        assert (
            generate(model, EagleProposer(head, target, tree=tree), prompt, config).tokens
            == generate_plain(model, prompt, config).tokens
        )


def test_a_head_trained_elsewhere_in_the_speculators_format_with_a_reduced_vocabulary_loads_and_drafts(
    tmp_path, target
):
    # given: a speculators-format checkpoint (layers.0.* names, the layer config nested) drafting 48 of 64 tokens
    head = seeded_head(4)
    tensors = {name.replace("midlayer.", "layers.0."): t for name, t in _checkpoint(head, tmp_path).items()}
    kept = torch.arange(0, V, 4).tolist() + torch.arange(1, V, 4).tolist() + torch.arange(2, V, 4).tolist()
    kept = sorted(kept)  # 48 target ids
    tensors["lm_head.weight"] = target.output.weight[kept].clone()
    tensors["d2t"] = torch.tensor(kept) - torch.arange(len(kept))
    tensors["t2d"] = torch.zeros(V, dtype=torch.bool)
    directory = tmp_path / "speculators"
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    layer = {k: v for k, v in head.hf_config().items() if k not in ("ace_eagle", "eagle_config", "architectures")}
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 48,
              "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
              "transformer_layer_config": {**layer, "draft_vocab_size": None},
              "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "tiny"}}}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    # when
    loaded = EagleHead.load(directory)
    # then: draft ids map back to the target's, the other tokens are never drafted, and greedy output is plain's
    g = torch.randn(2, H)
    logits = loaded.logits(g, target.output.weight)
    assert torch.isinf(logits[:, [3, 7, 11]]).all()
    torch.testing.assert_close(logits[:, kept], loaded.norm(g) @ target.output.weight[kept].T)
    model = LocalTarget(target)
    prompt, config = [4, 8, 15, 16, 23, 42], GenerationConfig(max_new_tokens=24, k=3)
    result = generate(model, EagleProposer(loaded, target), prompt, config)
    assert result.tokens == generate_plain(model, prompt, config).tokens


def _checkpoint(head: Eagle3Head, tmp_path) -> dict:
    head.save(tmp_path / "saved")
    return load_file(tmp_path / "saved" / "model.safetensors")


def test_sglangs_layer_numbering_in_eagle_config_reads_as_layer_outputs(tmp_path):
    from speculation.engine.eagle_format import aux_layer_ids

    assert aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}) == [2, 16, 29]
    assert aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [2, 16, 29], "eagle_config": {}}) == [2, 16, 29]
    assert aux_layer_ids({"architectures": ["LlamaForCausalLMEagle3"]}) is None  # the servers' default


def test_a_head_with_a_variant_ace_cannot_run_is_refused_with_the_reason(tmp_path):
    head = seeded_head()
    head.save(tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    del config["ace_eagle"]
    config["fc_norm"] = True
    (tmp_path / "h" / "config.json").write_text(json.dumps(config))
    with pytest.raises(EagleHeadError, match="fc_norm"):
        EagleHead.load(tmp_path / "h")


def test_for_target_makes_a_multi_layer_head_an_eagle3_head_on_vllms_default_layers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": H, "intermediate_size": 64,
                                                      "num_hidden_layers": 8, "num_attention_heads": 4,
                                                      "vocab_size": V}))  # fmt: skip
    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    config = EagleConfig.for_target(tmp_path, multi_layer=True)
    assert config.eagle3 and config.feature_layers == (1, 3, 4)  # vLLM's (2, n // 2, n - 3), as taps


def test_an_eagle3_head_trains_and_its_drafts_are_accepted(target, tmp_path):
    # given: the target's greedy continuations with its aux features
    head = seeded_head(5)
    train, held_out = greedy_sequences(target, 24, seed=1, layers=TAPS), greedy_sequences(target, 4, seed=2,
                                                                                         layers=TAPS)  # fmt: skip
    settings = TrainSettings(epochs=4, lr=3e-3, token_weight=1.0, feature_weight=0.1, batch_size=4, seed=0, unroll=2)
    # when
    reports = train_head(head, target.tok_embeddings.weight, target.output.weight, train, held_out, settings,
                         work_dir=tmp_path / "work")  # fmt: skip
    # then: held-out acceptance rises well above the untrained head's
    assert reports[-1].token_loss < reports[0].token_loss
    assert max(r.alpha for r in reports) > 0.2, reports
