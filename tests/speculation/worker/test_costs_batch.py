"""The batch-engine timing adapters compute what the batch decoder computes for a lone request: their logits and
drafts equal the batch-1 model's (so timing them times prod's batched local path, not a stand-in)."""

from __future__ import annotations

import torch

from speculation.engine import DraftModelProposer, LocalTarget, load_causal_lm
from speculation.engine.sampling import SamplingParams
from speculation.worker.costs_batch import BatchRowDraft, BatchRowTarget

GREEDY = SamplingParams(temperature=0.0)


def test_batch_row_target_verifies_like_the_local_target_and_rolls_back(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir))
    context, drafts = [1, 5, 9, 14, 20, 31], torch.tensor([7, 42, 100])
    batch, local = BatchRowTarget(model), LocalTarget(model)
    for target in (batch, local):
        target.prefill(context)
    first = batch.forward(drafts).logits
    assert torch.allclose(first, local.forward(drafts).logits, atol=1e-4)
    batch.rollback(len(context) - 1)
    assert torch.allclose(batch.forward(drafts).logits, first, atol=1e-5)  # rolled back: the same step again


def test_batch_row_draft_proposes_the_draft_models_greedy_tokens(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir))
    committed = [1, 5, 9, 14, 20]
    batch, single = BatchRowDraft(model), DraftModelProposer(model, target_vocab_size=model.vocab_size)
    for proposer in (batch, single):
        proposer.begin(committed)
    want = single.propose(committed, 4, GREEDY, None).tokens.tolist()
    assert batch.propose(committed, 4, GREEDY, None).tokens.tolist() == want
    committed = [*committed, want[0], 33]  # one accepted, then the target's token: the next step feeds both
    single.on_verified(1, 4)
    assert (
        batch.propose(committed, 3, GREEDY, None).tokens.tolist()
        == single.propose(committed, 3, GREEDY, None).tokens.tolist()
    )


def test_the_step_timer_keeps_the_batch_decoders_own_timings_of_each_size(tiny_model_dir, monkeypatch):
    from speculation.engine.batch import BatchDecoder
    from speculation.worker.costs_batch import BatchStepTimer

    # given: the decoder's step, spied on: what K it drafted and the timings it reported to its controller
    model = load_causal_lm(str(tiny_model_dir))
    reported = []
    original = BatchDecoder.step

    def step(self):
        updates = original(self)
        reported.append(self.lookahead.last)
        return updates

    monkeypatch.setattr(BatchDecoder, "step", step)
    timer = BatchStepTimer(model, draft=model, context=[1, 5, 9, 14, 20, 31])
    # when: a round over four sizes (after the warm-up round the first call runs)
    verify, drafts = timer.round((1, 2, 4, 9))
    # then: one step per size, plain step last; each size's time is the one the decoder measured for it, and a
    # draft step per drafted token from every drafting step but the first, which follows the warm-up round's plain
    # step (it also fed the draft that step's token: not a draft step's cost)
    ours = reported[-4:]
    assert len(reported) == 8 and [drafted for drafted, *_ in ours] == [8, 3, 1, 0]
    assert verify == {drafted + 1: verify_s for drafted, _, verify_s, _ in ours}
    assert [catch_up for *_, catch_up in ours] == [True, False, False, False]
    assert drafts == [draft_s / drafted for drafted, draft_s, _, _ in ours[1:3]]
