"""Every model family the engine runs, against transformers' own implementation of it.

Each family's checkpoint is a tiny random model built with transformers' own config class and saved with
save_pretrained (sharded safetensors), so tensor names and config keys are those of a real checkpoint. Weights are
scaled so that the top-2 logit gap along every compared path is far above float32 noise (checked): greedy tokens
are compared for equality, not within a tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculation.bench.families import build_checkpoint as build
from speculation.engine import (
    BatchDecoder,
    DraftModelProposer,
    GenerationConfig,
    LocalTarget,
    ModelFormatError,
    TreeShape,
    generate,
    generate_plain,
    load_causal_lm,
)
from speculation.engine.families import args_from_config, refusal
from speculation.engine.loader import default_dtype
from speculation.engine.prefix_cache import PrefixCache

transformers = pytest.importorskip("transformers")

VOCAB = 384
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
# family -> (config class name, what the family's real checkpoints set; alternate: sliding and full layers alternate);
# windows of 12 are shorter than prompt + output, so sliding layers really slide
FAMILIES = {
    "llama3": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
    ),  # fmt: skip
    "mistral": ("MistralConfig", dict(sliding_window=12)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            sliding_window=12,
            query_pre_attn_scalar=24,
            alternate=True,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=15.0,
        ),
    ),  # fmt: skip
    "gemma3": (
        "Gemma3TextConfig",
        dict(head_dim=16, sliding_window=12, alternate=True, tie_word_embeddings=False),
    ),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=2)),
}
# more rope scalings, checked for greedy exactness only
ROPES = {
    "llama-linear": (
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    ),
    "llama-yarn": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
    ),  # fmt: skip
    "llama-dynamic": (
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    ),
}
PROMPTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (3, 5, 8, 11, 13, 16, 18, 20)]  # fmt: skip
NEW_TOKENS = 32
MIN_GAP = 1e-3  # top-2 logit gap; float32 differences between the two implementations are about 1e-5


def build_checkpoint(directory: Path, family: str, *, seed: int, layers: int = 2) -> torch.nn.Module:
    """A tiny random checkpoint of the family, saved in shards; returns transformers' model (eager attention)."""
    class_name, extra = {**FAMILIES, **ROPES}[family]
    shape = {**SHAPE, "num_hidden_layers": layers}
    model = build(directory, class_name, extra, shape, seed=seed, shard="100KB")
    model.set_attn_implementation("eager")
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Built on first use: (directory, transformers model) per (family, role)."""
    built: dict[tuple[str, str], tuple[Path, torch.nn.Module]] = {}

    def get(family: str, role: str = "target") -> tuple[Path, torch.nn.Module]:
        if (family, role) not in built:
            directory = tmp_path_factory.mktemp(f"{family}-{role}")
            seed, layers = (0, 2) if role == "target" else (1, 1)
            built[family, role] = directory, build_checkpoint(directory, family, seed=seed, layers=layers)
        return built[family, role]

    return get


def transformers_greedy(model, prompt: list[int]) -> tuple[list[int], float]:
    """transformers' greedy continuation and the smallest top-2 logit gap along it."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)  # fmt: skip
    gap = min(float((lambda top: top[0] - top[1])(step[0].topk(2).values)) for step in out.logits)
    return out.sequences[0, len(prompt) :].tolist(), gap


@pytest.mark.parametrize("family", [*FAMILIES, *ROPES])
def test_it_decodes_greedy_tokens_identical_to_transformers(checkpoints, family):
    # given the family's checkpoint, loaded by the engine from its shards
    directory, reference = checkpoints(family)
    assert (directory / "model.safetensors.index.json").is_file()
    target = LocalTarget(load_causal_lm(directory))
    # when both decode 8 prompts greedily, 32 tokens each
    for prompt in PROMPTS:
        expected, gap = transformers_greedy(reference, prompt)
        got = generate_plain(target, prompt, GenerationConfig(max_new_tokens=NEW_TOKENS)).tokens
        # then: the same tokens, on paths with no near-tie
        assert got == expected, (family, prompt)
        assert gap > MIN_GAP, (family, gap)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_it_decodes_speculatively_as_plain_with_a_same_family_draft(checkpoints, family):
    # given the target and a one-layer random draft of the same family
    target_model = load_causal_lm(checkpoints(family)[0])
    draft_model = load_causal_lm(checkpoints(family, "draft")[0])
    target = LocalTarget(target_model)
    for prompt in PROMPTS[::2]:
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, k=3)
        # when decoding with the draft
        speculative = generate(target, DraftModelProposer(draft_model, target_vocab_size=VOCAB), prompt, config)
        # then: the plain tokens, with drafts really verified
        assert speculative.tokens == generate_plain(target, prompt, config).tokens, (family, prompt)
        assert speculative.stats.drafted_tokens > 0


def run_batch(decoder: BatchDecoder, prompts: list[list[int]], config: GenerationConfig) -> list[list[int]]:
    """Each prompt's tokens, the prompts joining as slots free up."""
    out: list[list[int]] = [[] for _ in prompts]
    waiting, finished = list(range(len(prompts))), 0
    while finished < len(prompts):
        while waiting and decoder.free:
            key = waiting.pop(0)
            decoder.add(key, prompts[key], config)
        for update in decoder.step():
            out[update.key] += update.tokens
            finished += update.finish_reason is not None
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_it_decodes_each_request_of_the_batch_loop_as_alone_with_its_prefix_cache(checkpoints, family):
    # given the batch loop over target and draft, 3 slots and a prefix cache
    target_model = load_causal_lm(checkpoints(family)[0])
    draft_model = load_causal_lm(checkpoints(family, "draft")[0])
    cache = PrefixCache(1 << 24, min_match=8)
    decoder = BatchDecoder(target_model, slots=3, draft=draft_model, prefix_cache=cache, max_context=128)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, k=2)
    # when: 6 prompts, then the last of them again (which reuses its first run's cached rows)
    out = run_batch(decoder, PROMPTS[:6], config) + run_batch(decoder, PROMPTS[5:6], config)
    # then: every request's tokens are those of single-request plain decoding
    target = LocalTarget(target_model)
    for prompt, tokens in zip([*PROMPTS[:6], PROMPTS[5]], out, strict=True):
        assert tokens == generate_plain(target, prompt, config).tokens, (family, prompt)
    assert cache.hits >= 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_it_samples_with_a_seed_the_tokens_transformers_samples_with_that_seed(checkpoints, family):
    # given the same checkpoint in both, temperature 0.8 and top-k 40
    directory, reference = checkpoints(family)
    target = LocalTarget(load_causal_lm(directory))
    for seed, prompt in enumerate(PROMPTS[:4]):
        # when both sample 32 tokens seeded alike
        torch.manual_seed(seed)
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8,
                                 top_k=40, top_p=1.0)  # fmt: skip
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=40, seed=seed)
        # then: the same tokens
        assert generate_plain(target, prompt, config).tokens == out[0, len(prompt) :].tolist(), (family, seed)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_it_drafts_from_multi_layer_features_in_chains_and_trees_as_plain(checkpoints, family):
    # given an untrained EAGLE-3-style head tapping the target's layer 0, for a chain and for a draft tree
    from speculation.engine.eagle import EagleConfig, EagleHead, EagleProposer, init_weights

    model = load_causal_lm(checkpoints(family)[0])
    a = model.args
    config = EagleConfig(hidden_size=a.dim, intermediate_size=2 * a.dim, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=VOCAB, max_position_embeddings=a.max_positions, feature_layers=(0,))  # fmt: skip
    head = EagleHead(config)
    init_weights(head, torch.Generator().manual_seed(0))
    target = LocalTarget(model)
    for prompt in PROMPTS[1:3]:
        plain = generate_plain(target, prompt, GenerationConfig(max_new_tokens=NEW_TOKENS)).tokens
        for tree in (None, TreeShape(top_k=2, depth=3, nodes=6)):
            # when
            result = generate(target, EagleProposer(head.eval(), model, tree=tree), prompt,
                              GenerationConfig(max_new_tokens=NEW_TOKENS, k=3))  # fmt: skip
            # then
            assert result.tokens == plain, (family, tree)


def test_it_loads_a_bf16_checkpoint_as_float32_on_the_cpu_and_keeps_bf16_for_cuda(checkpoints, tmp_path):
    # given a checkpoint saved in bfloat16 (as released ones are)
    directory, _ = checkpoints("qwen3")
    transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    # then: float32 on the CPU, its own bfloat16 for CUDA, and bfloat16 on the CPU when asked
    assert load_causal_lm(tmp_path).output.weight.dtype == torch.float32
    assert default_dtype(config, torch.device("cuda")) == torch.bfloat16
    assert default_dtype(config, torch.device("cpu")) == torch.float32
    assert load_causal_lm(tmp_path, dtype=torch.bfloat16).layers[0].attention.wqkv.weight.dtype == torch.bfloat16


def test_it_ties_the_lm_head_to_the_embedding_as_one_tensor(checkpoints):
    model = load_causal_lm(checkpoints("gemma2")[0])
    assert model.output.weight is model.tok_embeddings.weight


def test_it_refuses_a_sharded_checkpoint_whose_index_names_a_missing_shard(checkpoints, tmp_path):
    directory, _ = checkpoints("mistral")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    for name in set(index["weight_map"].values()):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="model-00099-of-00099"):
        load_causal_lm(tmp_path)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"model_type": "llama", "quantization_config": {"quant_method": "awq"}}, "quantized .*awq"),
        ({"model_type": "mixtral", "num_local_experts": 8}, "mixture-of-experts"),
        ({"model_type": "qwen3_moe", "num_experts": 64}, "mixture-of-experts"),
        ({"model_type": "t5", "is_encoder_decoder": True}, "encoder-decoder"),
        ({"model_type": "gemma3", "text_config": {}, "vision_config": {}}, "multimodal"),
        ({"model_type": "not_a_model"}, "model_type 'not_a_model' is not supported"),
        ({"model_type": "mamba"}, "recurrent or hybrid"),
    ],
)
def test_it_refuses_what_it_cannot_run_exactly_naming_the_reason(config, reason):
    assert refusal(config) is not None
    with pytest.raises(ModelFormatError, match=reason):
        args_from_config(config)


def test_it_refuses_a_rope_scaling_it_does_not_implement():
    config = {**SHAPE, "model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}
    with pytest.raises(ModelFormatError, match="rope type 'longrope' is not supported"):
        args_from_config(config)


def test_it_reads_the_config_layouts_transformers_4_wrote():
    # given config.json files as released checkpoints carry them (rope_scaling and rope_theta at the top level,
    # no layer_types)
    base = {**SHAPE, "head_dim": 16}
    llama31 = {**base, "model_type": "llama", "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3",
               "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}}  # fmt: skip
    gemma3 = {**base, "model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
              "sliding_window_pattern": 2, "query_pre_attn_scalar": 256}  # fmt: skip
    gemma2 = {**base, "model_type": "gemma2", "sliding_window": 4096, "num_hidden_layers": 4}
    qwen25 = {**base, "model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": False}
    # when read, then each says what transformers does with it
    a = args_from_config(llama31)
    assert (a.rope.type, a.rope_theta, a.rope.original_max_positions) == ("llama3", 500000.0, 8192)
    g3 = args_from_config(gemma3)
    assert (g3.rope.type, g3.rope.factor, g3.rope_theta, g3.local_rope_theta) == ("linear", 8.0, 1e6, 1e4)
    assert g3.windows == (512, None) and g3.attn_scale == 256**-0.5 and g3.tie_embeddings and g3.qk_norm
    assert args_from_config(gemma2).windows == (4096, None, 4096, None)
    assert args_from_config(qwen25).windows == () and args_from_config(qwen25).qkv_bias
