"""Shadow replays every compatible candidate at K = 1..8: the rows equal a direct engine replay, and the
per-endpoint budget sheds (and records) what does not fit."""

from __future__ import annotations

import base64
import json

import pytest
import redis
import torch
from django.conf import settings

from fleet.models import Endpoint, EndpointStatus
from speculation.engine import (
    HYBRID_LOOKUP_K,
    HybridProposer,
    NgramProposer,
    SuffixIndex,
    SuffixProposer,
)
from speculation.engine.projection import StepCosts
from speculation.engine.replay import (
    draft_greedy_predictions,
    replay_greedy,
    replay_proposals,
    replay_proposer,
    teacher_forced,
)
from speculation.models import CandidateMeasurement, SpeculationPolicy, StageRecord
from speculation.services.drafts import register_draft
from speculation.worker import candidates, suffix_store
from speculation.worker.paths import resources
from tests.support.models import serves

pytestmark = pytest.mark.django_db

PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 10, 11]
OUTPUT = [8, 5, 6, 7, 9, 10, 11, 8, 5, 6, 7, 12, 13]
BACKGROUND = "gpu.cpu.background"
COSTS = StepCosts(target_step_s=0.02, draft_step_s=0.002, verify_s={1: 0.02, 9: 0.03})


class FakeCalibration:
    def step_costs(self) -> StepCosts:
        return COSTS


@pytest.fixture
def endpoint(redis_server, tiny_model_dir, monkeypatch):
    draft = register_draft(name="tiny-draft", kind="draft_model", path=str(tiny_model_dir))
    endpoint = Endpoint.objects.create(
        name="cand",
        base_url="http://127.0.0.1:9/",
        status=EndpointStatus.READY,
        capabilities={"tokenizer_fingerprint": draft.tokenizer_fingerprint},
    )
    SpeculationPolicy.objects.create(endpoint=endpoint, mode="shadow", mechanism="ngram", k=3)
    Endpoint.objects.create(name="other", base_url="http://127.0.0.1:9/", capabilities={"tokenizer_fingerprint": "x"})
    monkeypatch.setattr(candidates, "current_costs", lambda **kwargs: FakeCalibration())  # no server to time
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter(candidates.BUDGET_KEY.format(endpoint_id=endpoint.pk, minute="*")):
        client.delete(key)  # an endpoint id of an earlier test's rolled-back rows may have spent this minute
    suffix_store.forget(endpoint.pk, redis_too=True)  # and may have stored responses
    return endpoint


def _measure(endpoint: Endpoint, request_id: str, workload: str = "code") -> list[CandidateMeasurement]:
    candidates.measure_candidates(
        endpoint=endpoint,
        policy=endpoint.policy,
        request_id=request_id,
        workload=workload,
        prompt_ids=PROMPT,
        output_ids=OUTPUT,
        max_tokens=len(OUTPUT),
    )
    return list(CandidateMeasurement.objects.filter(request_id=request_id).order_by("candidate"))


def test_compatible_candidates_are_the_lookups_and_the_drafts_with_the_endpoints_tokenizer(endpoint):
    register_draft(name="head", kind="ngram")  # a registered n-gram draft is not a second n-gram candidate
    # each draft model also behind suffix decoding (the hybrid), greedy only
    assert [c.name for c in candidates.compatible_candidates(endpoint)] == [
        "ngram",
        "suffix",
        "tiny-draft",
        "suffix+tiny-draft",
    ]
    hybrid = candidates.compatible_candidates(endpoint)[-1]
    assert hybrid.kind == "suffix_draft" and hybrid.draft.name == "tiny-draft"
    other = Endpoint.objects.get(name="other")
    assert [c.name for c in candidates.compatible_candidates(other)] == ["ngram", "suffix"]


def test_each_candidates_row_equals_a_direct_engine_replay_at_every_k(endpoint, tiny_model_dir):
    # given: earlier responses of the endpoint in its suffix store (written through Redis, read back by a process
    # that had none of them), one of them this request's own answer (stored by shadow before the replays run)
    earlier = {"old-1": [9, 10, 11, 8, 5], "old-2": [1, 10, 11, 8, 2], "old-3": [13, 14, 15], "req-1": OUTPUT}
    for key, answer in earlier.items():
        suffix_store.remember(endpoint.pk, key, answer)
    suffix_store.forget(endpoint.pk)
    # and what the engine's replays give directly
    sequence = PROMPT + OUTPUT
    predictions = draft_greedy_predictions(resources.model(str(tiny_model_dir)).model, sequence)
    lookup = NgramProposer()
    index = SuffixIndex()
    for key in ("old-1", "old-2", "old-3"):
        index.add(key, earlier[key])
    suffix = SuffixProposer(index)

    def replayed(proposer) -> list:
        return [
            replay_proposals(lambda n, d: proposer.lookup(sequence[:n], d), sequence, k, prompt_len=len(PROMPT))
            for k in range(1, 9)
        ]

    def hybrid(k: int) -> HybridProposer:  # the store's drafts where 3 tokens are found, else the draft's K
        return HybridProposer(suffix, teacher_forced(predictions), model_k=k)

    want = {
        "tiny-draft": [replay_greedy(predictions, sequence, k, prompt_len=len(PROMPT)) for k in range(1, 9)],
        "ngram": replayed(lookup),
        "suffix": replayed(suffix),  # without the request's own answer
        "suffix+tiny-draft": [
            replay_proposer(hybrid(k), sequence, max(k, HYBRID_LOOKUP_K), prompt_len=len(PROMPT)) for k in range(1, 9)
        ],
    }
    # when
    rows = _measure(endpoint, "req-1")
    # then
    assert sorted(r.candidate for r in rows) == ["ngram", "suffix", "suffix+tiny-draft", "tiny-draft"]
    rows = sorted(rows, key=lambda r: ["ngram", "suffix", "tiny-draft", "suffix+tiny-draft"].index(r.candidate))
    for row in rows:
        assert row.status == "measured" and row.workload == "code", row.reason
        stats = want[row.candidate]
        assert row.counts == [[s.drafted_tokens, s.accepted_tokens, s.target_passes] for s in stats]
        assert row.mean_accepted_len == [round(s.mean_accepted_len or 1.0, 4) for s in stats]
        assert row.per_position == [[round(a, 4) for a in s.alpha_per_position] for s in stats]
        k_means = [s.drafted_tokens / s.target_passes for s in stats]
        expected = [  # a hybrid's looked-up drafts cost no draft step
            round(COSTS.multiplier(tokens_per_step=s.tokens_per_pass, k=km, draft_steps=s.model_steps_per_pass), 4)
            for s, km in zip(stats, k_means, strict=True)
        ]
        assert row.multiplier == expected
        assert row.best_multiplier == max(expected) and row.multiplier[row.best_k - 1] == max(expected)
    assert rows[0].counts[2][1] > 0  # the repeated text gives n-gram lookup something to accept
    # the earlier answers give suffix decoding the first tokens (after "10 11" came "8"), which the prompt does not:
    # at K = 2 one more accepted and one verification fewer; with its own answer it would have accepted every draft
    assert rows[1].counts[1][1] > rows[0].counts[1][1] and rows[1].counts[1][2] < rows[0].counts[1][2]
    own = SuffixIndex()
    for key, answer in earlier.items():
        own.add(key, answer)
    leaked = replayed(SuffixProposer(own))
    assert [s.target_passes for s in leaked] != [s.target_passes for s in want["suffix"]]
    # the hybrid looked some drafts up and drafted the rest with the model, each counted as such
    assert all(0 < s.looked_up_tokens < s.drafted_tokens for s in want["suffix+tiny-draft"])


def test_the_budget_sheds_what_does_not_fit_and_says_so(endpoint, settings):
    settings.CANDIDATE_REPLAYS_PER_MINUTE = 6  # four candidates per request

    first = _measure(endpoint, "req-1")
    second = _measure(endpoint, "req-2")
    third = _measure(endpoint, "req-3")

    assert [r.status for r in first] == ["measured"] * 4
    assert sorted(r.status for r in second) == ["measured", "measured", "shed", "shed"]
    assert [r.status for r in third] == ["shed"] * 4
    shed = next(r for r in second if r.status == "shed")
    assert "budget of 6 candidate replays per minute" in shed.reason and shed.multiplier == []


def test_no_budget_means_no_candidate_replays(endpoint, settings):
    settings.CANDIDATE_REPLAYS_PER_MINUTE = 0
    assert _measure(endpoint, "req-1") == []


def _queued_candidates(client: redis.Redis) -> list[dict]:
    """The kwargs of every candidate-replay task on the background queue (kombu's JSON envelope, base64 body)."""
    out = []
    for raw in client.lrange(BACKGROUND, 0, -1):
        message = json.loads(raw)
        if message["headers"]["task"] == "speculation.tasks.replay_candidates_task":
            out.append(json.loads(base64.b64decode(message["body"]))[1])
    return out


def _shadowed(endpoint: Endpoint, request_id: str, monkeypatch, **fields) -> dict:
    """Shadow measures the known request (its projection stubbed); the one candidate task it queued."""
    from speculation.worker import shadow

    monkeypatch.setattr(shadow, "projection", lambda **kwargs: (1.5, "projection (test)", None))
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(BACKGROUND)
    shadow.measure_shadow(
        endpoint_id=endpoint.pk,
        request_id=request_id,
        prompt_ids=PROMPT,
        output_ids=OUTPUT,
        finish_reason="length",
        max_tokens=len(OUTPUT),
        latency_ms=100.0,
        **fields,
    )
    [job] = _queued_candidates(client)
    return job


def test_shadow_queues_the_candidates_in_the_background_and_the_task_writes_their_rows(endpoint, monkeypatch):
    from speculation.worker.tasks import replay_candidates_task

    job = _shadowed(endpoint, "req-9", monkeypatch, temperature=0.0, workload="faq")

    record = StageRecord.objects.get(request_id="req-9")
    assert record.workload == "faq" and record.mechanism == "ngram"
    # then: the shadow task itself replayed no candidate; one background task is queued for them
    assert not CandidateMeasurement.objects.filter(request_id="req-9").exists()
    assert job["node_class"] == "cpu" and job["sampling"] is None
    # when: the background task runs
    replay_candidates_task.apply(kwargs=job)
    rows = CandidateMeasurement.objects.filter(request_id="req-9")
    assert sorted(rows.values_list("candidate", "workload")) == [
        ("ngram", "faq"),
        ("suffix", "faq"),
        ("suffix+tiny-draft", "faq"),
        ("tiny-draft", "faq"),
    ]
    # the policy's own replay (n-gram, K = 3) agrees with the n-gram candidate's row at K = 3
    ngram = rows.get(candidate="ngram")
    assert ngram.counts[2] == [record.drafted_tokens, record.accepted_tokens, record.target_passes]
    # shadow stored the answer for suffix decoding before the replays ran; the suffix row did not draft from it
    # (the store had nothing else: it drafted from the request's own context only, as an empty store does)
    assert "req-9" in suffix_store.index_for(endpoint.pk)
    sequence = PROMPT + OUTPUT
    alone = SuffixProposer(SuffixIndex())
    want = replay_proposals(lambda n, d: alone.lookup(sequence[:n], d), sequence, 3, prompt_len=len(PROMPT))
    assert rows.get(candidate="suffix").counts[2] == [want.drafted_tokens, want.accepted_tokens, want.target_passes]


@pytest.mark.slow
def test_a_mixed_stream_ends_with_a_different_winner_per_workload_matching_a_brute_force_replay(
    endpoint, tiny_model_dir, settings
):
    import random

    from speculation.engine import GenerationConfig, LocalTarget, generate
    from speculation.selectors.autopairing import pairing_table

    settings.CANDIDATE_REPLAYS_PER_MINUTE = 1000
    draft_model = resources.model(str(tiny_model_dir)).model
    rng = random.Random(7)
    stream = []  # (workload, prompt, output)
    for _ in range(6):
        # code: a repeated block that the output goes on repeating (prompt lookup copies it; the draft cannot)
        block = [rng.randrange(3, 300) for _ in range(6)]
        stream.append(("code", block * 3, (block * 4)[:20]))
        # english: what the draft model itself would say (it predicts its own greedy text exactly), after a prompt
        # that ends as it began (a lookup drafts the prompt again, wrongly: the hybrid loses a step to it)
        half = [rng.randrange(3, 300) for _ in range(6)]
        prompt = half * 2
        stream.append(
            ("english", prompt, generate(LocalTarget(draft_model), None, prompt, GenerationConfig(20)).tokens)
        )
    # when: shadow measures every request
    for i, (workload, prompt, output) in enumerate(stream):
        candidates.measure_candidates(
            endpoint=endpoint, policy=endpoint.policy, request_id=f"mix-{i}", workload=workload,
            prompt_ids=prompt, output_ids=output, max_tokens=len(output),
        )  # fmt: skip
    table = pairing_table(endpoint_id=endpoint.pk)
    # then: the table's winner per workload is the brute-force argmax of the mean projected multiplier
    # (the suffix store is empty: measure_candidates alone stores no answer, shadow does)
    lookups = {"ngram": NgramProposer(), "suffix": SuffixProposer(SuffixIndex())}
    brute = {}
    for workload in ("code", "english"):
        means = {}
        for name in ("ngram", "suffix", "tiny-draft", "suffix+tiny-draft"):
            for k in range(1, 9):
                values = []
                for w, prompt, output in stream:
                    if w != workload:
                        continue
                    seq = prompt + output
                    if name in lookups:
                        stats = replay_proposals(
                            lambda n, d, s=seq, p=lookups[name]: p.lookup(s[:n], d), seq, k, prompt_len=len(prompt)
                        )
                    elif name == "tiny-draft":
                        stats = replay_greedy(
                            draft_greedy_predictions(draft_model, seq), seq, k, prompt_len=len(prompt)
                        )
                    else:
                        model = teacher_forced(draft_greedy_predictions(draft_model, seq))
                        hybrid = HybridProposer(lookups["suffix"], model, model_k=k)
                        stats = replay_proposer(hybrid, seq, max(k, HYBRID_LOOKUP_K), prompt_len=len(prompt))
                    k_mean = stats.drafted_tokens / stats.target_passes
                    steps = stats.model_steps_per_pass
                    values.append(
                        round(COSTS.multiplier(tokens_per_step=stats.tokens_per_pass, k=k_mean, draft_steps=steps), 4)
                    )
                means[(name, k)] = sum(values) / len(values)
        brute[workload] = max(means, key=lambda key: (means[key], -key[1]))
    got = {w: (e["recommendation"].candidate, e["recommendation"].k) for w, e in table["workloads"].items()}
    assert got == brute
    assert got["code"][0] != got["english"][0] and got["english"][0] == "tiny-draft"  # different winners


def _eagle_head(target_dir, out_dir, fingerprint: str, name: str):
    """An untrained EAGLE head saved for the target in target_dir, registered with the endpoint's tokenizer."""
    from speculation.engine.eagle import EagleConfig, EagleHead, init_weights
    from speculation.models import DraftModel

    head = EagleHead(EagleConfig.for_target(target_dir))
    init_weights(head, torch.Generator().manual_seed(0))
    head.save(out_dir)
    return DraftModel.objects.create(name=name, kind="eagle_head", path=str(out_dir), tokenizer_fingerprint=fingerprint)


def test_eagle_heads_of_the_target_in_the_worker_are_replayed_exactly(
    endpoint, tiny_model_dir, other_model_dir, tmp_path
):
    from speculation.engine.eagle import EagleHead, EagleProposer

    # given: a head for the policy's target, and one for another target (no candidate)
    fingerprint = endpoint.capabilities["tokenizer_fingerprint"]
    _eagle_head(tiny_model_dir, tmp_path / "head", fingerprint, "tiny-head")
    _eagle_head(other_model_dir, tmp_path / "other-head", fingerprint, "other-head")
    SpeculationPolicy.objects.filter(endpoint=endpoint).update(target_path=str(tiny_model_dir))
    serves(endpoint, tiny_model_dir)  # the endpoint's server runs the target
    endpoint.refresh_from_db()
    assert [c.name for c in candidates.compatible_candidates(endpoint)] == [
        "ngram",
        "suffix",
        "tiny-draft",
        "suffix+tiny-draft",
    ]
    listed = candidates.compatible_candidates(endpoint, target_path=str(tiny_model_dir))
    assert [c.name for c in listed] == ["ngram", "suffix", "tiny-draft", "suffix+tiny-draft", "tiny-head"]
    # when
    rows = {r.candidate: r for r in _measure(endpoint, "req-eagle")}
    # then: the head's row equals the engine's replay with the target's teacher-forced features
    model = resources.model(str(tiny_model_dir)).model
    head = EagleHead.load(tmp_path / "head", target_dir=tiny_model_dir)
    sequence = PROMPT + OUTPUT
    hidden = model(torch.tensor(sequence), 0, return_hidden=True).hidden
    want = [
        replay_proposer(EagleProposer(head, model), sequence, k, prompt_len=len(PROMPT), hidden=hidden)
        for k in range(1, 9)
    ]
    row = rows["tiny-head"]
    assert row.status == "measured" and row.kind == "eagle_head", row.reason
    assert row.counts == [[s.drafted_tokens, s.accepted_tokens, s.target_passes] for s in want]
    assert set(rows) == {"ngram", "suffix", "tiny-draft", "suffix+tiny-draft", "tiny-head"}


def test_a_target_path_that_is_not_the_endpoints_model_gives_no_candidate_its_features(
    endpoint, tiny_model_dir, other_model_dir, tmp_path
):
    # given: the policy's target_path holds another checkpoint than the endpoint's server runs, with a head for it
    fingerprint = endpoint.capabilities["tokenizer_fingerprint"]
    _eagle_head(other_model_dir, tmp_path / "other-head", fingerprint, "other-head")
    SpeculationPolicy.objects.filter(endpoint=endpoint).update(target_path=str(other_model_dir))
    serves(endpoint, tiny_model_dir)
    # when
    rows = {r.candidate: r for r in _measure(endpoint, "req-imposter")}
    # then: the replays run without that target (no EAGLE head is measured against another model)
    assert set(rows) == {"ngram", "suffix", "tiny-draft", "suffix+tiny-draft"}


def _passes(target_dir, draft_dir, sequence: list[int], outputs: list[int]) -> list[float]:
    """min(1, q(o) / p(o)) at each output position (temperature 0.7, top_p 0.9): the draft's probability of passing
    given the sampled token."""
    from speculation.engine import SamplingParams
    from speculation.engine.sampling import probs_from_logits

    params, start = SamplingParams(temperature=0.7, top_p=0.9), len(sequence) - len(outputs) - 1
    ids = torch.tensor(sequence[:-1])
    target, draft = resources.model(str(target_dir)).model, resources.model(str(draft_dir)).model
    p = probs_from_logits(target(ids, 0).logits[start:].float(), params)
    q = probs_from_logits(draft(ids, 0).logits[start:].float(), params)
    rows, out = torch.arange(len(outputs)), torch.tensor(outputs)
    p_o, q_o = p[rows, out], q[rows, out]
    # a token top-p cut (this output is not the target's sample): the average sum_x min(p, q) stands in
    average = torch.minimum(p, q).sum(-1)
    return torch.where(p_o > 0, torch.clamp(q_o / p_o.clamp(min=1e-30), max=1.0), average).tolist()


def test_sampled_requests_replay_the_draft_models_in_expectation(
    endpoint, tiny_model_dir, other_model_dir, monkeypatch
):
    from speculation.engine import expected_hybrid
    from speculation.models import DraftModel
    from speculation.worker.tasks import replay_candidates_task

    # given: shadow on sampled traffic with the policy's draft and the target both in the worker (exact)
    SpeculationPolicy.objects.filter(endpoint=endpoint).update(
        mechanism="draft_model", draft=DraftModel.objects.get(name="tiny-draft"), target_path=str(other_model_dir)
    )
    serves(endpoint, other_model_dir)  # the endpoint's server runs the target
    job = _shadowed(endpoint, "req-sampled", monkeypatch, temperature=0.7, top_p=0.9, workload="chat")
    assert job["sampling"] == {"temperature": 0.7, "top_k": 0, "top_p": 0.9}
    # when
    replay_candidates_task.apply(kwargs=job)
    # then: shadow's alpha is the mean sum_x min(p, q), neither 0 nor 1
    record = StageRecord.objects.get(request_id="req-sampled")
    assert 0.05 < record.alpha < 0.95
    rows = {r.candidate: r for r in CandidateMeasurement.objects.filter(request_id="req-sampled")}
    assert set(rows) == {"ngram", "suffix", "tiny-draft", "suffix+tiny-draft"}
    row = rows["tiny-draft"]
    assert row.status == "measured" and "exact" in row.reason and "given each sampled token" in row.reason
    # and the draft's row at every K is the expected replay with its probability of passing per sampled token
    sequence = PROMPT + OUTPUT
    passes = _passes(other_model_dir, tiny_model_dir, sequence, OUTPUT)
    want = [
        expected_hybrid(
            None, passes, sequence, k, prompt_len=len(PROMPT), lookup_k=k, min_lookup=3, max_new_tokens=len(OUTPUT)
        )
        for k in range(1, 9)
    ]
    assert row.mean_accepted_len == [round(s.mean_accepted_len, 4) for s in want]
    assert row.multiplier == [
        round(COSTS.multiplier(tokens_per_step=s.tokens_per_pass, k=s.drafted_tokens / s.target_passes), 4)
        for s in want
    ]
    assert [[pytest.approx(x, abs=0.01) for x in c] for c in row.counts] == [
        [s.drafted_tokens, s.accepted_tokens, s.target_passes] for s in want
    ]
    # shadow's own record is the same expectation at the policy's K (3), its counts rounded
    assert record.mean_accepted_len == pytest.approx(want[2].mean_accepted_len, abs=1e-6)
    assert record.target_passes == round(want[2].target_passes)


def test_sampled_requests_replay_the_lookups_and_the_hybrid_against_the_sampled_output(
    endpoint, tiny_model_dir, other_model_dir, monkeypatch
):
    from speculation.engine import HYBRID_MIN_LOOKUP, expected_hybrid
    from speculation.worker.tasks import replay_candidates_task

    # given: an earlier answer in the endpoint's store (the hybrid's lookup finds 2 tokens at the first step: the
    # draft model drafts; then the request's own context serves 3 or more)
    suffix_store.remember(endpoint.pk, "old-1", [9, 10, 11, 8, 5])
    # and shadow on a sampled request with the target in the worker
    SpeculationPolicy.objects.filter(endpoint=endpoint).update(target_path=str(other_model_dir))
    serves(endpoint, other_model_dir)  # the endpoint's server runs the target
    job = _shadowed(endpoint, "req-s2", monkeypatch, temperature=0.7, top_p=0.9, workload="chat")
    # when
    replay_candidates_task.apply(kwargs=job)
    rows = {r.candidate: r for r in CandidateMeasurement.objects.filter(request_id="req-s2")}
    sequence = PROMPT + OUTPUT
    index = SuffixIndex()
    index.add("old-1", [9, 10, 11, 8, 5])
    # then: n-gram lookup and suffix decoding: the greedy replay against the sampled output (exact)
    for name, lookup in (("ngram", NgramProposer()), ("suffix", SuffixProposer(index))):
        want = [
            replay_proposals(lambda n, d, lk=lookup: lk.lookup(sequence[:n], d), sequence, k, prompt_len=len(PROMPT))
            for k in range(1, 9)
        ]
        assert rows[name].status == "measured" and "sampled (temperature 0.7" in rows[name].reason
        assert "replayed against the sampled output (exact" in rows[name].reason
        assert rows[name].counts == [[s.drafted_tokens, s.accepted_tokens, s.target_passes] for s in want]
    # and the hybrid: expected_hybrid with the draft's probability of passing given each sampled token
    passes = _passes(other_model_dir, tiny_model_dir, sequence, OUTPUT)
    assert 0.0 < sum(passes) < len(passes)  # neither certain nor impossible: the expectation says something
    want = [
        expected_hybrid(
            lambda n, d: SuffixProposer(index).lookup(sequence[:n], d),
            passes,
            sequence,
            k,
            prompt_len=len(PROMPT),
            lookup_k=max(k, HYBRID_LOOKUP_K),
            min_lookup=HYBRID_MIN_LOOKUP,
            max_new_tokens=len(OUTPUT),
        )
        for k in range(1, 9)
    ]
    hybrid = rows["suffix+tiny-draft"]
    assert hybrid.status == "measured" and "given each sampled token" in hybrid.reason, hybrid.reason
    got = [[pytest.approx(x, abs=0.01) for x in c] for c in hybrid.counts]
    assert got == [[s.drafted_tokens, s.accepted_tokens, s.target_passes] for s in want]
    assert any(s.looked_up_tokens > 0 for s in want) and any(s.looked_up_tokens < s.drafted_tokens for s in want)
    assert hybrid.mean_accepted_len == [round(s.mean_accepted_len, 4) for s in want]
