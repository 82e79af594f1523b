"""bench_autopairing's arithmetic: online auto-pairing learns per workload from earlier requests only, by the
product's rule (after PROD_MIN_REQUESTS pooled requests, the workload's shrunk winner; before, the policy's pairing),
and the report compares it with the best single candidate and the per-workload oracle on the same requests."""

from __future__ import annotations

import pytest

from speculation.bench.autopairing import Measured, report, simulate
from speculation.selectors.autopairing import PROD_MIN_REQUESTS
from speculation.services.autopairing import AUTO_MIN_REQUESTS


def request(workload: str, ngram: float, draft: float, *, i: int = 0) -> Measured:
    jitter = 0.01 if (i // 2) % 2 else -0.01  # draws alternate within each workload: the interval has a width
    values = {("ngram", 4): ngram + jitter, ("draft", 4): draft + jitter}
    return Measured(workload=workload, multiplier=values, tokens_per_step={key: 2 * v for key, v in values.items()})


def test_auto_pairing_learns_a_different_winner_per_workload_from_earlier_requests_only():
    # given: code favours n-gram (2.0 vs 1.2), english the draft (1.5 vs 1.0), alternating
    n = 2 * PROD_MIN_REQUESTS + 20
    stream = [request("code", 2.0, 1.2, i=i) if i % 2 else request("english", 1.0, 1.5, i=i) for i in range(2 * n)]

    chosen = simulate(stream, first=("draft", 4))

    # then: the policy's draft until PROD_MIN_REQUESTS requests are pooled; then code runs its own winner at once
    # (its one request's 2.0 vs 1.2 outweighs the pooled means, shrunk by PRIOR_REQUESTS)
    assert chosen[:PROD_MIN_REQUESTS] == [("draft", 4)] * PROD_MIN_REQUESTS
    assert {chosen[i] for i in range(PROD_MIN_REQUESTS, 2 * n) if stream[i].workload == "code"} == {("ngram", 4)}
    assert {chosen[i] for i in range(2 * n) if stream[i].workload == "english"} == {("draft", 4)}
    result = report(stream, chosen)
    assert result["best_single"] == "ngram@K4"  # n * 2.0 + n * 1.0 > n * 1.2 + n * 1.5
    assert result["workloads"]["english"]["oracle"] == "draft@K4"
    assert result["overall_gain"] > 1.0 and 0.0 <= result["regret"] < 0.1
    # the ceiling of the gain (the oracle's own), and the second half without the first requests' learning
    assert result["oracle_over_best_single"] >= result["overall_gain"]
    assert result["second_half"]["requests"] == n and result["second_half"]["regret"] < result["regret"]
    english = result["workloads"]["english"]
    assert english["best_single_projected"] == pytest.approx(1.0) and english["oracle_projected"] == pytest.approx(1.5)


def test_a_new_workload_runs_the_pooled_winner():
    # given: one big workload where n-gram is far better, and a rare one seen twice at the end, level there
    stream = [request("a", 3.0, 1.0, i=i) for i in range(AUTO_MIN_REQUESTS + 2)] + [request("rare", 1.0, 1.0)] * 2

    chosen = simulate(stream, first=("draft", 4))

    # then: the rare workload runs the pooled winner (its own level evidence does not move it)
    assert chosen[0] == ("draft", 4)
    assert chosen[-2:] == [("ngram", 4), ("ngram", 4)]


def test_before_a_workload_has_its_own_evidence_it_runs_the_pooled_winner_not_the_starting_draft():
    # given: three workloads in turn, n-gram far better everywhere; the policy starts on the draft
    stream = [request("abc"[i % 3], 2.0, 1.0, i=i // 3) for i in range(3 * PROD_MIN_REQUESTS)]

    chosen = simulate(stream, first=("draft", 4))

    # then: once PROD_MIN_REQUESTS requests are pooled, n-gram runs; long before draft: auto's AUTO_MIN_REQUESTS
    # would have moved the policy
    assert PROD_MIN_REQUESTS < AUTO_MIN_REQUESTS
    assert chosen[:PROD_MIN_REQUESTS] == [("draft", 4)] * PROD_MIN_REQUESTS
    assert set(chosen[PROD_MIN_REQUESTS:]) == {("ngram", 4)}


def test_measurements_saved_and_simulated_again_give_the_same_report(tmp_path):
    from speculation.bench.autopairing import dump_measurements, evaluate, load_measurements, resimulate
    from speculation.engine.projection import StepCosts

    stream = [request("code", 2.0, 1.2, i=i) if i % 2 else request("english", 1.0, 1.5, i=i) for i in range(40)]
    costs = {"ngram": StepCosts(target_step_s=0.1, draft_step_s=0.0, verify_s={2: 0.12, 6: 0.2})}
    path = tmp_path / "m.json"
    dump_measurements(path, stream, costs)

    loaded, loaded_costs = load_measurements([path])

    assert loaded == stream and loaded_costs["ngram"].v(5) == pytest.approx(costs["ngram"].v(5))
    assert resimulate([path])["workloads"] == evaluate(stream, costs)["workloads"]


def test_the_command_refuses_a_file_that_is_not_measurements_with_exit_code_2(tmp_path):
    from django.core.management import CommandError, call_command

    bad = tmp_path / "bad.json"
    bad.write_text('{"requests": 3}')
    with pytest.raises(CommandError, match="not a bench_autopairing measurements file") as raised:
        call_command("bench_autopairing", "--from-measurements", str(bad))
    assert raised.value.returncode == 2
    with pytest.raises(CommandError, match="unknown demo pair version") as raised:
        call_command("bench_autopairing", "--demo-version", "demo-v99", "--requests", "1")
    assert raised.value.returncode == 2


def test_suffix_decodings_store_in_the_bench_holds_the_answers_before_each_request(tiny_model_dir):
    from speculation.bench.autopairing import measure
    from speculation.models import DraftKind
    from speculation.worker.candidates import Candidate

    # given: the same prompt three times, then another (greedy answers: the repeats answer the same)
    candidates = [Candidate("ngram", DraftKind.NGRAM), Candidate("suffix", DraftKind.SUFFIX)]
    prompts = ["the quick brown fox"] * 3 + ["over the lazy dog"]
    # when
    measured, costs = measure(target_dir=str(tiny_model_dir), candidates=candidates, prompts=prompts, max_tokens=24)
    # then: the first request has no earlier answer (suffix decoding is prompt lookup there, at most); the repeats
    # draft the first answer (the store holds answers, not prompts: the first step finds nothing), so they project
    # far above prompt lookup on the same request, which finds a draft on few steps
    mult = [m.multiplier for m in measured]
    assert mult[0][("suffix", 4)] < mult[1][("suffix", 4)] == mult[2][("suffix", 4)]
    assert mult[1][("suffix", 4)] > 1.5 * mult[1][("ngram", 4)]
    assert set(costs) == {"ngram", "suffix"} and costs["suffix"].draft_step_s > 0


def test_a_draft_behind_suffix_decoding_is_measured_and_shards_price_it_again_the_same(tiny_model_dir, tmp_path):
    from speculation.bench.autopairing import measure
    from speculation.bench.autopairing_store import dump_measurements, load_measurements
    from speculation.models import DraftKind, DraftModel
    from speculation.worker.candidates import Candidate

    # given: suffix decoding, the tiny draft, and the draft behind suffix decoding; a prompt asked twice, then another
    draft = DraftModel(name="tiny", path=str(tiny_model_dir))
    candidates = [
        Candidate("suffix", DraftKind.SUFFIX),
        Candidate("tiny", DraftKind.DRAFT_MODEL, draft),
        Candidate("suffix+tiny", DraftKind.SUFFIX_DRAFT, draft),
    ]
    prompts = ["the quick brown fox", "the quick brown fox", "over the lazy dog", "jumps over it"]
    # when
    measured, costs = measure(target_dir=str(tiny_model_dir), candidates=candidates, prompts=prompts, max_tokens=24)
    # then: the hybrid's model steps are the draft's, charged only where the lookup found too little: on the repeated
    # prompt it drafts mostly from the store, with fewer model steps per pass than the draft alone
    assert costs["suffix+tiny"].draft_step_s == costs["tiny"].draft_step_s > costs["suffix"].draft_step_s
    repeat = measured[1]
    assert repeat.model_steps[("suffix+tiny", 4)] < repeat.model_steps[("tiny", 4)] == repeat.k_mean[("tiny", 4)]
    assert repeat.multiplier[("suffix+tiny", 4)] > repeat.multiplier[("tiny", 4)]
    # and shards merged price every request again with one cost model, the hybrid's model steps included: with the
    # same costs, the same multipliers
    dump_measurements(tmp_path / "a.json", measured[::2], costs)
    dump_measurements(tmp_path / "b.json", measured[1::2], costs)
    merged, _ = load_measurements([tmp_path / "a.json", tmp_path / "b.json"])
    for again, first in zip(merged, measured, strict=True):
        assert again.multiplier == pytest.approx(first.multiplier)


def test_sampled_answers_replay_the_drafts_in_expectation_and_the_lookups_exactly(tiny_model_dir):
    from speculation.bench.autopairing import measure
    from speculation.engine import GenerationConfig, LocalTarget, SamplingParams, generate
    from speculation.models import DraftKind, DraftModel
    from speculation.worker.candidates import Candidate
    from speculation.worker.paths import resources

    # given: the target as its own draft (q = p: a sampled draft passes with probability min(1, q(o)/p(o)) = 1)
    draft = DraftModel(name="same", path=str(tiny_model_dir))
    candidates = [
        Candidate("ngram", DraftKind.NGRAM),
        Candidate("same", DraftKind.DRAFT_MODEL, draft),
        Candidate("suffix+same", DraftKind.SUFFIX_DRAFT, draft),
    ]
    prompts = ["the quick brown fox", "over the lazy dog"]
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    # when the answers are sampled
    measured, _ = measure(
        target_dir=str(tiny_model_dir), candidates=candidates, prompts=prompts, max_tokens=24, sampling=sampling
    )
    # then every draft passes: K + 1 tokens per step where the budget allows, for the draft and for its hybrid
    for request in measured:
        assert request.tokens_per_step[("same", 1)] == pytest.approx(2.0, abs=0.05)
        assert request.tokens_per_step[("same", 3)] == pytest.approx(4.0, abs=0.3)
        assert request.tokens_per_step[("suffix+same", 3)] >= 3.5
    # and the answers were sampled (not the greedy ones the lookups would otherwise be replayed on)
    loaded = resources.model(str(tiny_model_dir))
    ids = loaded.tokenizer(prompts[0])["input_ids"]
    greedy = generate(LocalTarget(loaded.model), None, ids, GenerationConfig(max_new_tokens=24)).tokens
    sampled = generate(
        LocalTarget(loaded.model), None, ids, GenerationConfig(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=0)
    ).tokens
    assert sampled != greedy


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-1"], "--temperature must be > 0"),
        (["--top-p", "0.5"], "--temperature must be > 0"),
        (["--temperature", "0.7", "--top-p", "1.5"], "top_p must be in"),
    ],
)
def test_bad_sampling_options_exit_with_code_2(args, message):
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match=message) as raised:
        call_command("bench_autopairing", "--requests", "1", *args)
    assert raised.value.returncode == 2
