"""Timing prod's local step as it runs (speculation.worker.step_timing): the batch timer keeps the decoder's own
timings of each size, and the relay runs prod's per-step work beside the steps."""

from __future__ import annotations

from speculation.engine import load_causal_lm


def test_the_step_timer_keeps_the_batch_decoders_own_timings_of_each_size(tiny_model_dir, monkeypatch):
    from speculation.engine.batch import BatchDecoder
    from speculation.worker.step_timing import BatchStepTimer

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
    from speculation.worker.step_timing import BatchStepTimer, StepRelay

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

    from speculation.worker.step_timing import StepRelay

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

    from speculation.worker.step_timing import StepRelay

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
