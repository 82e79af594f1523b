"""Continuous batching: every slot of a batch is exactly its request alone.

Equalities (no tolerance): greedy slots, joining at different steps with prompts of different lengths, are
token-identical to plain decoding of each request alone; a sampled slot draws with its own seeded generator in
the order generate() does, so it gives the tokens generate() gives with that seed, whoever its neighbours are.
Statistical (stated tolerance): sampled slots follow the target's processed distribution (chi-square against
exact enumeration, rejected at p < 1e-3, and the same check rejects a wrong sampler).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from speculation.engine import (
    HYBRID_LOOKUP_K,
    DraftModelProposer,
    EmptyPromptError,
    GenerationConfig,
    HybridProposer,
    LoadAwareLookahead,
    LocalTarget,
    NgramProposer,
    SamplingParams,
    SuffixIndex,
    SuffixProposer,
    generate,
    generate_plain,
)
from speculation.engine import batch as batch_module
from speculation.engine.batch import BatchDecoder, BatchFullError
from tests.support.stats import chi2_critical, chi2_statistic, exact_sequence_distribution, wrong_verify_sampled

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [7, 7, 7, 7, 2, 3, 4, 5, 6, 1, 2, 3, 4], [9, 8], [3] * 20]
JOIN_AT = [0, 0, 1, 3, 6, 7]  # the step before which each request arrives


def run(decoder: BatchDecoder, requests: list[tuple[list[int], GenerationConfig]], join_at: list[int]):
    """Feed requests as they arrive (a full batch keeps them waiting); -> tokens per request, largest batch."""
    out: dict[Hashable, list[int]] = {i: [] for i in range(len(requests))}
    waiting, done, step, largest = list(range(len(requests))), set(), 0, 0
    while len(done) < len(requests):
        while waiting and join_at[waiting[0]] <= step and decoder.free:
            key = waiting.pop(0)
            decoder.add(key, *requests[key])
        largest = max(largest, len(decoder))
        for update in decoder.step():
            out[update.key] += update.tokens
            if update.finish_reason:
                done.add(update.key)
        step += 1
        assert step < 1000, "the batch never finished"
    return out, largest


def _earlier_answers(target_model) -> SuffixIndex:
    """Suffix decoding's store: the target's greedy answers to the test prompts, one token in 4 changed."""
    index = SuffixIndex()
    for i, prompt in enumerate(PROMPTS):
        answer = generate_plain(LocalTarget(target_model), prompt, GenerationConfig(max_new_tokens=30)).tokens
        index.add(f"r{i}", [(t + 1) % target_model.vocab_size if j % 4 == 3 else t for j, t in enumerate(answer)])
    return index


def decoder_for(kind: str, target_model, draft_model, *, slots: int = 3, lookahead=None) -> BatchDecoder:
    return BatchDecoder(
        target_model,
        slots=slots,
        draft=draft_model if kind in ("draft", "hybrid") else None,
        ngram=NgramProposer()
        if kind == "ngram"
        else SuffixProposer(_earlier_answers(target_model))
        if kind in ("suffix", "hybrid")
        else None,
        lookahead=lookahead,
        max_context=target_model.max_len,
    )


@pytest.mark.parametrize("load_aware", [False, True])
@pytest.mark.parametrize("kind", ["draft", "ngram", "suffix", "hybrid", "plain"])
def test_greedy_slots_joining_at_different_steps_equal_plain_decoding_of_each_request_alone(
    target_model, draft_model, kind, load_aware
):
    # given six requests of different prompt lengths, K and lengths, arriving at different steps, 3 slots
    requests = [(p, GenerationConfig(max_new_tokens=18 + 5 * i, k=2 + i % 4)) for i, p in enumerate(PROMPTS)]
    decoder = decoder_for(kind, target_model, draft_model, lookahead=LoadAwareLookahead() if load_aware else None)
    # when
    out, largest = run(decoder, requests, JOIN_AT)
    # then: each equals plain greedy decoding of that request alone, and the batch was really shared
    for i, (prompt, config) in enumerate(requests):
        assert out[i] == generate_plain(LocalTarget(target_model), prompt, config).tokens, i
    assert largest == 3


def test_a_hybrid_slot_takes_the_steps_its_request_alone_takes_greedy_and_sampled(target_model, draft_model):
    # given greedy and seeded sampled requests, batched 3 at a time behind suffix decoding with the draft's fallback
    # (the store: the target's answers with one token in 4 changed, so lookups are partly rejected)
    requests = [(p, GenerationConfig(max_new_tokens=24 + 3 * i, k=1 + i % 3)) for i, p in enumerate(PROMPTS[:4])]
    requests += [(p, replace(sampled(11 + j), k=1 + j)) for j, p in enumerate((PROMPTS[4], PROMPTS[5], PROMPTS[0]))]
    decoder = decoder_for("hybrid", target_model, draft_model)
    stats = {}
    out: dict[Hashable, list[int]] = {i: [] for i in range(len(requests))}
    waiting = list(range(len(requests)))
    while waiting or len(decoder):
        while waiting and decoder.free:
            key = waiting.pop(0)
            decoder.add(key, *requests[key])
        for update in decoder.step():
            out[update.key] += update.tokens
            if update.finish_reason:
                stats[update.key] = update.stats
    # then: each slot's tokens and its step counts (drafts, acceptances, what the lookup served) are those of
    # HybridProposer on the request alone, with the request's K as the draft's and the lookup's own cap
    index = _earlier_answers(target_model)
    for i, (prompt, config) in enumerate(requests):
        draft = DraftModelProposer(draft_model, target_vocab_size=target_model.vocab_size)
        alone = generate(
            LocalTarget(target_model),
            HybridProposer(SuffixProposer(index), draft, model_k=config.k),
            prompt,
            replace(config, k=max(config.k, HYBRID_LOOKUP_K)),
        )
        assert out[i] == alone.tokens, i
        assert stats[i].counts() == alone.stats.counts(), i
    looked = sum(s.looked_up_tokens for s in stats.values())
    assert 0 < looked < sum(s.drafted_tokens for s in stats.values())  # both drafters drafted


def test_a_hybrid_step_where_every_slot_looked_up_runs_no_draft_model_step(target_model, draft_model):
    # given two requests whose prompts and answers the store holds (the lookup finds long drafts at once)
    index = SuffixIndex()
    for i in (0, 1):
        answer = generate_plain(LocalTarget(target_model), PROMPTS[i], GenerationConfig(max_new_tokens=30)).tokens
        index.add(f"r{i}", PROMPTS[i] + answer)
    decoder = BatchDecoder(
        target_model, slots=2, draft=draft_model, ngram=SuffixProposer(index), max_context=target_model.max_len
    )
    proposals = []
    original = decoder._draft_model_proposals
    decoder._draft_model_proposals = lambda draft, ks: proposals.append(ks) or original(draft, ks)
    decoder.add("a", PROMPTS[0], GenerationConfig(max_new_tokens=30, k=2))
    decoder.add("b", PROMPTS[1], GenerationConfig(max_new_tokens=30, k=2))
    # when the first step runs
    updates = decoder.step()
    # then both drafted from the lookup (past the request's K, up to the lookup's own cap), every draft accepted
    # (the store holds the target's answers), and the draft model did not run
    assert proposals == [] and len(updates) == 2
    assert all(2 < u.drafted <= HYBRID_LOOKUP_K and u.accepted == u.drafted for u in updates)


def test_a_hybrids_lookups_follow_the_controller_for_greedy_slots_and_keep_their_cap_for_seeded_ones(
    target_model, draft_model
):
    class NoLookupsAtThisLoad(LoadAwareLookahead):
        def choose(self, batch_size: int, *, k_max: int, **_) -> int:
            return 2

        def choose_lookup(self, batch_size: int, *, k_max: int, **_) -> int:
            return 0

    # given: a store holding each prompt with its answer, so a lookup always finds a long draft
    index = SuffixIndex()
    for i in (0, 1):
        answer = generate_plain(LocalTarget(target_model), PROMPTS[i], GenerationConfig(max_new_tokens=30)).tokens
        index.add(f"r{i}", PROMPTS[i] + answer)
    decoder = BatchDecoder(
        target_model,
        slots=2,
        draft=draft_model,
        ngram=SuffixProposer(index),
        lookahead=NoLookupsAtThisLoad(),
        max_context=target_model.max_len,
    )
    decoder.add("greedy", PROMPTS[0], GenerationConfig(max_new_tokens=20, k=4))
    decoder.add("seeded", PROMPTS[1], replace(sampled(5), k=4))
    # when
    updates = {u.key: u for u in decoder.step()}
    # then: the greedy slot drafted the model's K of the controller; the seeded one looked up as it would alone
    assert (updates["greedy"].looked_up, updates["greedy"].drafted) == (False, 2)
    assert updates["seeded"].looked_up and updates["seeded"].drafted > 4


def test_stop_tokens_min_tokens_and_context_ends_are_per_slot(target_model, draft_model):
    # given: the first tokens plain decoding gives each prompt, to stop on
    first = [generate_plain(LocalTarget(target_model), p, GenerationConfig(max_new_tokens=12)).tokens for p in PROMPTS]
    configs = [
        GenerationConfig(max_new_tokens=30, k=4, stop_token_ids=(first[0][5],)),
        GenerationConfig(
            max_new_tokens=30, k=3, stop_token_ids=(first[1][2],), min_tokens=6, suppress_ids=(first[1][2],)
        ),
        GenerationConfig(max_new_tokens=30, k=5, max_context=14),
        GenerationConfig(max_new_tokens=0, k=3),
        GenerationConfig(max_new_tokens=40, k=2),
    ]
    requests = list(zip(PROMPTS, configs, strict=False))
    # when
    out, _ = run(decoder_for("draft", target_model, draft_model), requests, [0, 0, 1, 1, 2])
    # then: each slot stops where generate() stops the request alone
    for i, (prompt, config) in enumerate(requests):
        proposer = DraftModelProposer(draft_model, target_vocab_size=target_model.vocab_size)
        assert out[i] == generate(LocalTarget(target_model), proposer, prompt, config).tokens, i
    assert out[0][-1] == first[0][5] and len(out[2]) == 14 - len(PROMPTS[2]) and out[3] == []


def test_a_slot_that_leaves_early_frees_its_row_and_the_others_continue_exactly(target_model, draft_model):
    # given four running requests
    decoder = decoder_for("draft", target_model, draft_model, slots=4)
    config = GenerationConfig(max_new_tokens=30, k=3)
    for i in range(4):
        decoder.add(i, PROMPTS[i], config)
    out = {i: [] for i in range(4)}
    # when: request 1 (a middle row) is cancelled after 3 steps and request 3 (the last row) after 5
    for step in range(60):
        if step == 3:
            assert decoder.remove(1)
        if step == 5:
            assert decoder.remove(3)
        for update in decoder.step():
            out[update.key] += update.tokens
    # then: the others are exact, and the freed rows take new requests
    for i in (0, 2):
        assert out[i] == generate_plain(LocalTarget(target_model), PROMPTS[i], config).tokens
    assert len(decoder) == 0 and decoder.free == 4 and not decoder.remove(1)


def test_a_full_batch_and_a_bad_prompt_are_refused_at_join(target_model):
    decoder = decoder_for("plain", target_model, None, slots=1)
    decoder.add("a", [1, 2], GenerationConfig(max_new_tokens=4))
    with pytest.raises(BatchFullError):
        decoder.add("b", [1, 2], GenerationConfig(max_new_tokens=4))
    with pytest.raises(EmptyPromptError):
        decoder.add("c", [], GenerationConfig(max_new_tokens=4))


def sampled(seed: int, **kwargs) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=30, k=3, temperature=0.8, top_p=0.9, seed=seed, **kwargs)


def test_a_sampled_slot_draws_what_its_request_alone_draws_with_that_seed(target_model, draft_model):
    # given sampled requests (seeds 7, 8, 9) batched with greedy ones, and under a load-aware K
    requests = [(PROMPTS[0], sampled(7)), (PROMPTS[1], GenerationConfig(max_new_tokens=25, k=4))]
    requests += [(PROMPTS[2], sampled(8, top_k=5)), (PROMPTS[3], sampled(9)), (PROMPTS[4], sampled(7))]
    decoder = decoder_for("draft", target_model, draft_model, slots=4, lookahead=LoadAwareLookahead())
    # when
    out, _ = run(decoder, requests, [0, 0, 1, 2, 4])
    # then: each equals generate() of the request alone with its seed: neighbours and load change nothing
    for i, (prompt, config) in enumerate(requests):
        proposer = DraftModelProposer(draft_model, target_vocab_size=target_model.vocab_size)
        assert out[i] == generate(LocalTarget(target_model), proposer, prompt, config).tokens, i
    alone_other_seed = generate(
        LocalTarget(target_model), DraftModelProposer(draft_model, target_vocab_size=48), PROMPTS[0], sampled(8)
    )
    assert out[0] != alone_other_seed.tokens  # the seed matters (30 tokens at temperature 0.8)


def test_greedy_slots_follow_the_load_aware_k_and_sampled_slots_keep_theirs(target_model, draft_model):
    class PlainAtThisLoad(LoadAwareLookahead):
        def choose(self, batch_size: int, *, k_max: int, **_) -> int:
            return 0

    requests = [(PROMPTS[0], GenerationConfig(max_new_tokens=20, k=4)), (PROMPTS[1], sampled(3))]
    requests.append((PROMPTS[2], sampled(4, fixed_k=False)))  # a request that set no seed
    decoder = decoder_for("draft", target_model, draft_model, lookahead=PlainAtThisLoad())
    for key, request in enumerate(requests):
        decoder.add(key, *request)
    drafted = {0: 0, 1: 0, 2: 0}
    while len(decoder):
        for update in decoder.step():
            drafted[update.key] += update.drafted
    assert drafted[0] == 0  # K = 0: plain batched decoding
    assert drafted[1] > 0  # the seed's draws stay those of the request's own K
    assert drafted[2] == 0  # no seed to reproduce: the controller's K, as a greedy slot's


def test_unseeded_sampled_slots_draft_the_k_chosen_for_sampled_acceptance(target_model, draft_model):
    class ByKind(LoadAwareLookahead):
        """K = 3 for greedy slots, 0 for sampled ones; records how it was asked."""

        def choose(self, batch_size: int, *, k_max: int, sampled: bool = False, count: bool = True) -> int:
            self.asked = [*getattr(self, "asked", []), (sampled, count)]
            return 0 if sampled else 3

    lookahead = ByKind()
    decoder = decoder_for("draft", target_model, draft_model, lookahead=lookahead)
    decoder.add("greedy", PROMPTS[0], GenerationConfig(max_new_tokens=20, k=5))
    decoder.add("sampled", PROMPTS[1], sampled(5, fixed_k=False))
    drafted: dict[str, list[int]] = {"greedy": [], "sampled": []}
    for update in decoder.step():
        drafted[update.key].append(update.drafted)
    assert drafted == {"greedy": [3], "sampled": [0]}
    assert lookahead.asked == [(False, True), (True, False)]  # one step counted once
    # and the step's acceptance went to the greedy estimate only (the sampled slot drafted nothing)
    assert lookahead.sampled_reached < 4.0 and lookahead.reached > 0.9 * 4.0


def test_sampled_slots_follow_the_targets_processed_distribution(monkeypatch, make_tiny_model):
    # given a 4-token vocabulary: the 64 three-token continuations are enumerated exactly; 400 seeded requests
    # served 8 at a time, each batched with neighbours of other seeds
    target_model = make_tiny_model(vocab=4, dim=16, layers=1, seed=3, std=0.6)
    draft_model = make_tiny_model(vocab=4, dim=16, layers=1, seed=4, std=0.9)
    params = SamplingParams(temperature=0.7, top_p=0.9)
    exact = exact_sequence_distribution(target_model, [1, 2], 3, params)

    def counts(fixed_k: bool = True) -> torch.Tensor:
        found = torch.zeros(64)
        for first in range(0, 400, 8):
            lookahead = None if fixed_k else KEachStep()
            decoder = BatchDecoder(
                target_model, slots=8, draft=draft_model, max_context=target_model.max_len, lookahead=lookahead
            )
            for seed in range(first, first + 8):
                config = GenerationConfig(max_new_tokens=3, k=2, temperature=0.7, top_p=0.9, seed=seed, fixed_k=fixed_k)
                decoder.add(seed, [1, 2], config)
            out: dict[Hashable, list[int]] = {}
            while len(decoder):
                for update in decoder.step():
                    out.setdefault(update.key, []).extend(update.tokens)
            for a, b, c in out.values():
                found[a * 16 + b * 4 + c] += 1
        return found

    class KEachStep(LoadAwareLookahead):
        """A controller whose K changes every step (2, 0, 1, 2, ...): unseeded slots draft what it says."""

        def choose(self, batch_size: int, *, k_max: int, **_) -> int:
            self.calls = getattr(self, "calls", 0) + 1
            return (self.calls + 1) % 3

    # when / then: p < 1e-3 rejects (a false alarm in 0.1 % of runs) ...
    stat, dof = chi2_statistic(counts(), exact)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} >= {chi2_critical(dof):.1f} (dof {dof})"
    # ... also when requests without a seed draft a K that changes every step (each step's rejection sampling is
    # exact at its own K) ...
    stat, dof = chi2_statistic(counts(fixed_k=False), exact)
    assert stat < chi2_critical(dof), f"K per step: chi2 {stat:.1f} >= {chi2_critical(dof):.1f} (dof {dof})"
    # ... and the same check rejects a wrong sampler (recovered token from p, not the residual)
    monkeypatch.setattr(batch_module, "verify_sampled", wrong_verify_sampled)
    stat, dof = chi2_statistic(counts(), exact)
    assert stat >= chi2_critical(dof), f"the wrong sampler passed: chi2 {stat:.1f} (dof {dof})"


def test_a_forward_over_some_rows_only_equals_theirs_in_a_forward_over_all_and_leaves_the_others(target_model):
    from speculation.engine.batch_model import BatchedModel

    # given two caches with the same three rows (prompts of different lengths)
    prompts = [PROMPTS[1], PROMPTS[3][:9], PROMPTS[0]]
    models = [BatchedModel(target_model, max_rows=3, max_len=target_model.max_len) for _ in range(2)]
    for model in models:
        model.reserve(3, 32)
        feed = pad_sequence([torch.tensor(p[:-1]) for p in prompts], batch_first=True)
        model.forward(feed, [0, 0, 0], last=[len(p) - 2 for p in prompts])
    untouched = models[1].read_row(1, len(prompts[1]) - 1)
    # when: rows 0 and 2 take their next tokens, in a forward over all rows and in one over those two only
    nxt = torch.tensor([[p[-1], 5] for p in prompts])
    starts = [len(p) - 1 for p in prompts]
    everyone = models[0].forward(nxt, starts)
    some = models[1].forward(nxt[[0, 2]], [starts[0], starts[2]], rows=[0, 2])
    # then: the same logits and the same cached rows, and row 1 as it was
    torch.testing.assert_close(some, everyone[[0, 2]])
    for row in (0, 2):
        for (k0, v0), (k1, v1) in zip(
            models[0].read_row(row, starts[row] + 2), models[1].read_row(row, starts[row] + 2), strict=True
        ):
            torch.testing.assert_close(k1, k0)
            torch.testing.assert_close(v1, v0)
    for (k0, v0), (k1, v1) in zip(untouched, models[1].read_row(1, len(prompts[1]) - 1), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    with pytest.raises(ValueError, match="2 rows for 3 inputs"):
        models[1].forward(nxt, starts, rows=[0, 2])
