"""A dense decoder-only model ACE's own layer does not describe runs through transformers' model (engine/generic.py),
exactly: GPT-NeoX (Pythia's family) and GPT-2, tiny random checkpoints written by transformers' own config classes.

Weights are scaled as in test_model_families (wide embeddings), so the top-2 logit gap along every compared path is
far above float32 noise (checked): greedy tokens are compared for equality.
"""

from __future__ import annotations

import json

import pytest
import torch

from speculation.bench.families import build_checkpoint as build
from speculation.engine import (
    DraftModelProposer,
    GenerationConfig,
    LocalTarget,
    ModelFormatError,
    generate,
    generate_plain,
    load_causal_lm,
)
from speculation.engine.families import implementation, refusal

transformers = pytest.importorskip("transformers")

VOCAB = 384
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128)  # fmt: skip
FAMILIES = {
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.25)),  # Pythia: partial rotary, parallel residual, LayerNorm
    "gpt2": ("GPT2Config", dict(bos_token_id=0, eos_token_id=0)),  # learned positions, fused c_attn (Conv1D)
}
PROMPTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (3, 5, 8, 11, 13, 16, 18, 20)]  # fmt: skip
NEW_TOKENS = 32
MIN_GAP = 1e-3  # top-2 logit gap; the cached and uncached passes differ by about 1e-6 in float32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Built on first use: (directory, transformers model) per (family, role). The draft is the target plus noise,
    so that it agrees often but not always (accepted and rejected drafts both occur)."""
    built: dict[tuple[str, str], tuple] = {}

    def get(family: str, role: str = "target"):
        if (family, role) not in built:
            class_name, extra = FAMILIES[family]
            directory = tmp_path_factory.mktemp(f"{family}-{role}")
            model = build(directory, class_name, extra, SHAPE, seed=0, shard="100KB")
            if role == "draft":
                torch.manual_seed(1)
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(torch.randn_like(param) * 0.05)
                model.save_pretrained(directory)
            built[family, role] = directory, model
        return built[family, role]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_it_decodes_greedy_tokens_identical_to_transformers_through_its_model(checkpoints, family):
    # given a checkpoint of a family ACE's own layer does not describe
    directory, reference = checkpoints(family)
    model = load_causal_lm(directory)
    assert model.implementation == "generic"
    target = LocalTarget(model)
    # when both decode 8 prompts greedily, 32 tokens each
    for prompt in PROMPTS:
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)  # fmt: skip
        gap = min(float((lambda top: top[0] - top[1])(step[0].topk(2).values)) for step in out.logits)
        got = generate_plain(target, prompt, GenerationConfig(max_new_tokens=NEW_TOKENS)).tokens
        # then: the same tokens, on paths with no near-tie
        assert got == out.sequences[0, len(prompt) :].tolist(), (family, prompt)
        assert gap > MIN_GAP, (family, gap)


def test_it_decodes_speculatively_as_plain_cutting_the_cache_back_on_rejection(checkpoints):
    # given a GPT-NeoX target and a same-family draft that agrees often but not always
    target = LocalTarget(load_causal_lm(checkpoints("gpt_neox")[0]))
    draft = load_causal_lm(checkpoints("gpt_neox", "draft")[0])
    accepted = drafted = 0
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, k=3)
        # when decoding with the draft
        result = generate(target, DraftModelProposer(draft, target_vocab_size=VOCAB), prompt, config)
        # then: the plain tokens
        assert result.tokens == generate_plain(target, prompt, config).tokens, prompt
        accepted, drafted = accepted + result.stats.accepted_tokens, drafted + result.stats.drafted_tokens
    # and drafts were both accepted and rejected (so the caches were cut back)
    assert 0 < accepted < drafted


def test_it_samples_with_a_seed_the_tokens_transformers_samples_with_that_seed(checkpoints):
    directory, reference = checkpoints("gpt_neox")
    target = LocalTarget(load_causal_lm(directory))
    for seed, prompt in enumerate(PROMPTS[:4]):
        torch.manual_seed(seed)
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8,
                                 top_k=40, top_p=1.0)  # fmt: skip
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=40, seed=seed)
        assert generate_plain(target, prompt, config).tokens == out[0, len(prompt) :].tolist(), seed


def test_it_refuses_features_and_trees_naming_the_model_type(checkpoints):
    model = load_causal_lm(checkpoints("gpt_neox")[0])
    with pytest.raises(ModelFormatError, match="'gpt_neox' runs through transformers"):
        model(torch.tensor([1, 2]), 0, return_hidden=True)


def test_it_refuses_a_model_whose_state_cannot_be_cut_back(tmp_path):
    # given a state-space checkpoint (transformers implements it as a causal LM, but it keeps no KV cache)
    config = {"model_type": "mamba", "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    # then: refused at registration's check and by the loader, naming the reason
    assert "recurrent" in refusal(config)
    with pytest.raises(ModelFormatError, match="recurrent or hybrid"):
        load_causal_lm(tmp_path)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"model_type": "llama"}, "native"),
        ({"model_type": "gemma3_text"}, "native"),
        ({"model_type": "gpt_neox"}, "generic"),
        ({"model_type": "opt"}, "generic"),
        ({"model_type": "falcon"}, "generic"),
    ],
)
def test_it_says_which_implementation_runs_a_config(config, expected):
    assert implementation(config) == expected


def test_it_refuses_an_eagle_head_over_a_target_transformers_runs(checkpoints):
    from speculation.engine.eagle import EagleConfig, EagleHead, EagleHeadError, EagleProposer

    model = load_causal_lm(checkpoints("gpt_neox")[0])
    config = EagleConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=VOCAB, max_position_embeddings=128)  # fmt: skip
    with pytest.raises(EagleHeadError, match="runs through transformers"):
        EagleProposer(EagleHead(config), model)
