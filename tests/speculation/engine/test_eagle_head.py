"""The EAGLE head: shapes, its cache, save/load, the target check, and exactness inside the engine's loop."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculation.engine import GenerationConfig, LocalTarget, ModelArgs, Transformer, generate, generate_plain
from speculation.engine import init_weights as init_target
from speculation.engine.eagle import (
    EagleConfig,
    EagleHead,
    EagleHeadError,
    EagleProposer,
    init_weights,
    target_fingerprint,
)
from speculation.engine.errors import VocabMismatchError
from speculation.engine.sampling import SamplingParams, probs_from_logits
from speculation.offline.eagle.train import TrainSettings, train_head
from tests.support.eagle import greedy_sequences


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models on a shared 2-core machine: one thread avoids oversubscription stalls.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_target(*, vocab: int = 64, seed: int = 0, sharpness: float = 30.0) -> Transformer:
    """A random 2-layer target; scaling its LM head makes its distributions peaked like a trained model's."""
    args = ModelArgs(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                     max_positions=128)  # fmt: skip
    model = Transformer(args)
    init_target(model, torch.Generator().manual_seed(seed))
    model.output.weight.data *= sharpness
    model.setup_cache()
    return model.eval().requires_grad_(False)


def head_config(vocab: int = 64) -> EagleConfig:
    return EagleConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=vocab, max_position_embeddings=128)  # fmt: skip


def random_head(vocab: int = 64, seed: int = 0) -> EagleHead:
    head = EagleHead(head_config(vocab))
    init_weights(head, torch.Generator().manual_seed(seed))
    return head.eval()


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_target()


@pytest.fixture(scope="module")
def trained_head(target, tmp_path_factory) -> EagleHead:
    """A head trained briefly on the target's own greedy continuations (enough for drafts to be accepted)."""
    head = EagleHead(head_config())
    settings = TrainSettings(epochs=5, lr=3e-3, token_weight=1.0, batch_size=4, seed=0)
    train, held_out = greedy_sequences(target, 24, seed=1), greedy_sequences(target, 3, seed=2)
    reports = train_head(head, target.tok_embeddings.weight, target.output.weight, train, held_out, settings,
                         work_dir=tmp_path_factory.mktemp("head-train"))  # fmt: skip
    assert reports[-1].alpha > 0.2, reports[-1]
    return head.eval()


# --- the module ------------------------------------------------------------------------------------------------


def test_the_head_predicts_one_feature_per_position():
    head = random_head()
    features, embeds = torch.randn(2, 7, 32), torch.randn(2, 7, 32)

    predicted = head(features, embeds)

    assert predicted.shape == (2, 7, 32)
    assert head.fc.weight.shape == (32, 64)  # [embedding, feature] -> hidden


def test_drafting_through_the_cache_matches_one_pass_over_the_sequence():
    head = random_head()
    features, embeds = torch.randn(1, 12, 32), torch.randn(1, 12, 32)
    head.setup_cache(32)

    with torch.no_grad():
        whole = head(features, embeds)
        pieces = [head(features[:, :7], embeds[:, :7], 0, use_cache=True)]
        pieces += [head(features[:, i : i + 1], embeds[:, i : i + 1], i, use_cache=True) for i in range(7, 12)]

    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-5)


# --- save / load -----------------------------------------------------------------------------------------------


def save_target_dir(model: Transformer, directory: Path) -> Path:
    """Write a model's weights in Hugging Face Llama layout, enough for the fingerprint and the loader."""
    a = model.args
    config = {"model_type": "llama", "hidden_size": a.dim, "intermediate_size": a.intermediate_size,
              "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
              "vocab_size": a.vocab_size, "max_position_embeddings": a.max_positions, "rms_norm_eps": a.norm_eps,
              "rope_theta": a.rope_theta}  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    return directory


def test_a_saved_head_loads_back_with_the_same_outputs(tmp_path, target):
    target_dir = save_target_dir(target, tmp_path / "target")
    config = replace(head_config(), target_name="tiny", target_fingerprint=target_fingerprint(target_dir))
    head = EagleHead(config)
    init_weights(head, torch.Generator().manual_seed(3))
    features, embeds = torch.randn(1, 5, 32), torch.randn(1, 5, 32)

    head.save(tmp_path / "head")
    loaded = EagleHead.load(tmp_path / "head", target_dir=target_dir)

    torch.testing.assert_close(loaded(features, embeds), head(features, embeds), atol=0, rtol=0)
    meta = json.loads((tmp_path / "head" / "config.json").read_text())
    assert meta["ace_eagle"]["target_name"] == "tiny"
    assert meta["num_hidden_layers"] == 1


def test_the_saved_weights_use_vllms_eagle_layout(tmp_path):
    random_head().save(tmp_path / "head")

    names = set(load_file(str(tmp_path / "head" / "model.safetensors")))

    assert names == {
        "fc.weight",
        *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "layers.0.post_attention_layernorm.weight",
    }


def test_loading_a_head_against_another_target_fails_clearly(tmp_path, target):
    trained_for = save_target_dir(target, tmp_path / "target-a")
    other = save_target_dir(tiny_target(seed=7), tmp_path / "target-b")
    config = replace(head_config(), target_name="target-a", target_fingerprint=target_fingerprint(trained_for))
    EagleHead(config).save(tmp_path / "head")

    with pytest.raises(EagleHeadError, match="trained for target 'target-a'.*train a head for this target"):
        EagleHead.load(tmp_path / "head", target_dir=other)


def test_a_directory_without_a_head_is_a_clear_error(tmp_path):
    with pytest.raises(EagleHeadError, match="not an ACE EAGLE head directory"):
        EagleHead.load(tmp_path)


def test_a_head_for_another_vocabulary_is_refused(target):
    with pytest.raises(VocabMismatchError):
        EagleProposer(random_head(vocab=80), target)


# --- exactness in the engine's loop ----------------------------------------------------------------------------


PROMPTS = [[3, 9, 27, 1], [5], [60, 2, 2, 2, 41, 7, 19, 33, 8], list(range(20))]


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_eagle_greedy_output_is_token_identical_to_plain_greedy(target, trained_head, k):
    local = LocalTarget(target)
    proposer = EagleProposer(trained_head, target)
    accepted = 0
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=40, k=k)

        plain = generate_plain(local, prompt, config).tokens
        speculative = generate(local, proposer, prompt, config)

        assert speculative.tokens == plain, (
            f"prompt {prompt}: first difference at {_first_difference(plain, speculative.tokens)}"
        )
        accepted += speculative.stats.accepted_tokens
    assert accepted > 0  # drafts were accepted, so the accept path was exercised


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def exact_joint(model: Transformer, prompt: list[int], n: int, params: SamplingParams) -> dict[tuple, float]:
    """The target's exact distribution of its next n tokens, by enumeration."""
    vocab = model.vocab_size
    joint: dict[tuple, float] = {(): 1.0}
    for _ in range(n):
        grown: dict[tuple, float] = {}
        for prefix, mass in joint.items():
            with torch.inference_mode():
                logits = model(torch.tensor(prompt + list(prefix)), 0).logits[-1]
            probs = probs_from_logits(logits, params).tolist()
            for token in range(vocab):
                grown[prefix + (token,)] = mass * probs[token]
        joint = grown
    return joint


def chi_square_p_value(counts: dict[tuple, int], expected: dict[tuple, float], n: int) -> float:
    """Pearson chi-square goodness of fit; cells expected below 5 are pooled into one."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in expected.items():
        e, o = p * n, counts.get(cell, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat += (o - e) ** 2 / e
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    # Wilson-Hilferty: chi-square(dof) tail through a normal approximation (good for dof >= 3).
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


SAMPLES = 3000
NEW_TOKENS = 3
P_VALUE_FLOOR = 1e-3


@pytest.mark.slow
def test_eagle_sampling_follows_the_targets_exact_distribution():
    """Speculative sampling with an (untrained, so often rejected) head reproduces p exactly.

    3,000 draws of the next 3 tokens over a 5-token vocabulary (125 cells), compared with the enumerated
    joint distribution by a chi-square test: a correct sampler fails it with probability 1e-3 (the floor).
    The same test rejects the head's own distribution (drafts taken without verification), proving power.
    """
    model = tiny_target(vocab=5, seed=11, sharpness=3.0)
    head = random_head(vocab=5, seed=12)  # untrained: q differs from p, so rejections happen
    prompt = [1, 4, 2]
    params = SamplingParams(temperature=1.0)
    expected = exact_joint(model, prompt, NEW_TOKENS, params)
    local, proposer = LocalTarget(model), EagleProposer(head, model)

    counts: dict[tuple, int] = {}
    rejected = 0
    for seed in range(SAMPLES):
        result = generate(local, proposer, prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, k=4, temperature=1.0,
                                                                     seed=seed))  # fmt: skip
        counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
        rejected += result.stats.drafted_tokens - result.stats.accepted_tokens
    assert rejected > SAMPLES // 10  # the rejection path carried real weight

    assert chi_square_p_value(counts, expected, SAMPLES) > P_VALUE_FLOOR

    # Power: the drafts alone (no verification) are distributed as q, and the test says so.
    draft_counts: dict[tuple, int] = {}
    generator = torch.Generator().manual_seed(0)
    for _ in range(SAMPLES):
        proposer.begin(prompt)
        tokens = tuple(proposer.propose(list(prompt), NEW_TOKENS, params, generator).tokens.tolist())
        draft_counts[tokens] = draft_counts.get(tokens, 0) + 1
    assert chi_square_p_value(draft_counts, expected, SAMPLES) < P_VALUE_FLOOR
