"""A draft and a target of one tokenizer whose checkpoints pad the vocabulary to different sizes (Qwen's do)."""

from __future__ import annotations

import pytest
import torch

from speculation.engine import (
    BatchDecoder,
    DraftModelProposer,
    GenerationConfig,
    LocalTarget,
    ModelArgs,
    Transformer,
    VocabMismatchError,
    generate,
    generate_plain,
)
from speculation.engine.sampling import SamplingParams
from speculation.engine.vocab import draft_width, widen
from tests.support.models import draft_of

TOKENIZER = 40  # ids both checkpoints mean alike; the rest of each vocabulary is padding
PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [9, 9, 3, 7]]


def padded(model: Transformer, vocab: int, *, loud: float, seed: int = 5) -> Transformer:
    """``model`` with its vocabulary padded to ``vocab`` rows of random weights times ``loud`` (a draft's loud ones
    would win its argmax if they were ever read; a target's are quiet, as trained checkpoints' are)."""
    args = ModelArgs(**{**model.args.__dict__, "vocab_size": vocab})
    out = Transformer(args)
    state = model.state_dict()
    generator = torch.Generator().manual_seed(seed)
    for name in ("tok_embeddings.weight", "output.weight"):
        rows = torch.randn(vocab, args.dim, generator=generator) * loud
        keep = min(vocab, state[name].shape[0])
        rows[:keep] = state[name][:keep]
        state[name] = rows
    out.load_state_dict(state)
    out.eval().requires_grad_(False)
    out.setup_cache()
    return out


@pytest.fixture(scope="module")
def padded_pair(target_model):
    """(target, draft): the target padded to 64 ids, its draft to 56, one tokenizer of 40 ids."""
    return padded(target_model, 64, loud=0.0), padded(draft_of(target_model), 56, loud=20.0, seed=6)


def test_it_refuses_different_vocabularies_without_a_shared_tokenizer_or_beyond_it():
    with pytest.raises(VocabMismatchError, match="no shared tokenizer"):
        draft_width(56, 64)
    with pytest.raises(VocabMismatchError, match="do not fit"):
        draft_width(56, 64, 60)
    assert draft_width(48, 48) == 48 and draft_width(56, 64, TOKENIZER) == TOKENIZER


def test_it_widens_a_drafts_logits_to_the_targets_ids_with_nothing_past_the_tokenizer():
    logits = torch.arange(56.0).expand(2, 56)
    wide = widen(logits, TOKENIZER, 64)
    assert wide.shape == (2, 64)
    assert torch.equal(wide[:, :TOKENIZER], logits[:, :TOKENIZER]) and torch.isinf(wide[:, TOKENIZER:]).all()


def test_it_drafts_among_the_tokenizers_ids_and_decodes_greedy_as_plain(padded_pair):
    # given a target and a draft of one tokenizer padded to different sizes
    target_model, draft_model = padded_pair
    target = LocalTarget(target_model)
    config = GenerationConfig(max_new_tokens=24, k=3)
    accepted = 0
    for prompt in PROMPTS:
        # when the draft drafts for the target
        proposer = DraftModelProposer(draft_model, target_vocab_size=64, shared_vocab=TOKENIZER)
        result = generate(target, proposer, prompt, config)
        # then: the target's own greedy tokens, with drafts accepted
        assert result.tokens == generate_plain(target, prompt, config).tokens
        accepted += result.stats.accepted_tokens
    assert accepted > 0


def test_its_sampled_drafts_are_distributions_over_the_targets_ids(padded_pair):
    target_model, draft_model = padded_pair
    proposer = DraftModelProposer(draft_model, target_vocab_size=64, shared_vocab=TOKENIZER)
    proposer.begin(PROMPTS[0])
    params = SamplingParams(temperature=1.0)
    proposal = proposer.propose(PROMPTS[0], 4, params, torch.Generator().manual_seed(0))
    assert proposal.q.shape == (4, 64)
    assert (proposal.q[:, TOKENIZER:] == 0).all() and torch.allclose(proposal.q.sum(-1), torch.ones(4))
    assert (proposal.tokens < TOKENIZER).all()
    # and a seeded sampled run through the loop finishes with the target's ids only
    result = generate(LocalTarget(target_model), proposer, PROMPTS[1], GenerationConfig(max_new_tokens=16, k=3,
                      temperature=0.8, seed=3))  # fmt: skip
    assert len(result.tokens) == 16


def test_the_batch_loop_drafts_with_a_padded_draft_as_alone(padded_pair):
    target_model, draft_model = padded_pair
    config = GenerationConfig(max_new_tokens=20, k=3)
    with pytest.raises(VocabMismatchError):
        BatchDecoder(target_model, slots=2, draft=draft_model)
    decoder = BatchDecoder(target_model, slots=len(PROMPTS), draft=draft_model, shared_vocab=TOKENIZER)
    for i, prompt in enumerate(PROMPTS):
        decoder.add(i, prompt, config)
    out: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    while len(decoder):
        for update in decoder.step():
            out[update.key] += update.tokens
    for i, prompt in enumerate(PROMPTS):
        assert out[i] == generate_plain(LocalTarget(target_model), prompt, config).tokens, i
