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


def test_the_timer_relays_each_steps_tokens_as_a_request_thread_does(tiny_model_dir, redis_server):
    import json

    import redis
    from transformers import AutoTokenizer

    from speculation.engine import BatchDecoder, GenerationConfig
    from speculation.worker.costs_batch import BatchStepTimer, StepRelay

    # given: a relay on the test's Redis, spied on (its round trips), beside a step timer
    model = load_causal_lm(str(tiny_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    client = redis.Redis.from_url(redis_server.url)
    relay = StepRelay(tokenizer, client=client)
    stepped = []
    timer = BatchStepTimer(
        model, draft=model, context=[1, 5, 9, 14, 20, 31], relay=lambda ids: stepped.append(ids) or relay.put(ids)
    )
    # when: two rounds (a warm-up round first) of three sizes
    timer.round((1, 3, 5))
    timer.round((1, 3, 5))
    relay.close()
    # then: every step's committed tokens went out, in order, in one message each, with the text they complete
    messages = [json.loads(m) for m in client.lrange(relay._stream.channel.key, 0, -1)]
    assert len(stepped) == 9 and relay.relayed == 9 and [m["ids"] for m in messages] == stepped
    ids = [t for step in stepped for t in step]
    assert "".join(m["text"] for m in messages) == tokenizer.decode(ids, skip_special_tokens=True)
    assert 0 < client.ttl(relay._stream.channel.key) <= 300  # nobody reads it: it expires
    # and the tokens are what the decoder commits for that context greedily (the relay times prod's real work)
    decoder = BatchDecoder(model, slots=1, draft=model)
    decoder.add("x", [1, 5, 9, 14, 20, 31], GenerationConfig(max_new_tokens=len(ids), k=4))
    out = []
    while len(decoder):
        out += [t for u in decoder.step() for t in u.tokens]
    assert out == ids


def test_the_relay_runs_the_matcher_without_redis(tiny_model_dir):
    from transformers import AutoTokenizer

    from speculation.worker.costs_batch import StepRelay

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    relay = StepRelay(tokenizer, client=None)
    for ids in ([5, 9], [14], [2, 20]):  # 2: the end token; a calibration's slot runs past it
        relay.put(ids)
    relay.close()
    assert relay.relayed == 3 and relay._stream.matcher.output_ids == [5, 9, 14, 2, 20]


def test_the_relay_goes_on_when_the_matcher_fails(tiny_model_dir, redis_server):
    import json

    import redis
    from transformers import AutoTokenizer

    from speculation.worker.costs_batch import StepRelay

    class Broken:  # a tokenizer that fails on one token (a calibration must not lose its relay thread to it)
        def __init__(self, inner):
            self.inner = inner

        def decode(self, ids, **kwargs):
            if 13 in ids:
                raise ValueError("cannot decode 13")
            return self.inner.decode(ids, **kwargs)

    client = redis.Redis.from_url(redis_server.url)
    relay = StepRelay(Broken(AutoTokenizer.from_pretrained(str(tiny_model_dir))), client=client)
    for ids in ([5, 9], [13], [14]):
        relay.put(ids)
    relay.close()
    messages = [json.loads(m) for m in client.lrange(relay._stream.channel.key, 0, -1)]
    assert relay.relayed == 3 and [m["ids"] for m in messages] == [[5, 9], [13], [14]]
    assert messages[1]["text"] == ""


def test_a_policy_on_a_model_transformers_runs_is_timed_single_stream(settings, tiny_model_dir, tmp_path):
    # given batching on, and local-path policies whose target or draft runs through transformers (generic)
    import json

    from speculation.models import DraftModel, SpeculationPolicy, VerificationPath
    from speculation.worker.costs import batched_path

    settings.PROD_BATCH_SLOTS = 4
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    native = DraftModel(kind="draft_model", path=str(tiny_model_dir))
    generic = DraftModel(kind="draft_model", path=str(tmp_path))

    def policy(target: str, draft: DraftModel) -> SpeculationPolicy:
        return SpeculationPolicy(mechanism="draft_model", draft=draft, target_path=target)

    # then: the batch loop's costs only where both are native (batching.serves runs the others at batch one)
    assert batched_path(policy=policy(str(tiny_model_dir), native), path=VerificationPath.LOCAL)
    assert not batched_path(policy=policy(str(tiny_model_dir), generic), path=VerificationPath.LOCAL)
    assert not batched_path(policy=policy(str(tmp_path), native), path=VerificationPath.LOCAL)
