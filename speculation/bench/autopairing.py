"""Auto-pairing on a mixed workload: per workload, the auto-paired candidate and K against every single candidate
and against the per-workload oracle (`bench_autopairing`).

One process, no server: the target (the engine's Transformer, loaded from --target) answers each prompt greedily
(--temperature: sampled, each candidate then replayed as shadow replays a sampled request);
every candidate (n-gram, suffix decoding over the answers earlier in the stream, each --drafts directory sharing the
target's tokenizer, and each of them behind suffix decoding: the hybrid suffix+DRAFT) is replayed on the answer at K
= 1..8 with the same code shadow runs (speculation.worker.candidates.replay: exact for greedy), and so is the
target's EAGLE head (--eagle; its features from one teacher-forced pass of the target). In a sharded run (--shard)
suffix decoding's store holds the earlier answers of its own shard only, a lower bound of the whole stream's. The
projected multiplier per request uses costs measured here once per candidate (speculation.engine.costs: the target's
verification of n tokens and the draft's step, the fastest repeat; an EAGLE step is the head's layer + the target's
LM head; a suffix lookup is timed over a store the size of the stream's prompts): the local path's cost model.

Auto-pairing is simulated online with the product's own rule (speculation.selectors.autopairing: the table
aggregated from the earlier requests' rows exactly as the endpoint page and prod's worker aggregate them): request r
of workload w runs `workload_choice` over the requests before it (after PROD_MIN_REQUESTS pooled requests, w's
(candidate, K) with the highest mean shrunk toward the pooled one; before, the policy's pairing), and the policy's
pairing itself moves as `draft: auto` moves it (speculation.services.autopairing.auto_decision: the pooled winner,
with its minimum of evidence and margin), starting from the first draft at K = 5. Every candidate is replayed on
every request (as shadow does), so the choice learns from full information. The workload is the key the gateway
gives the prompt (the automatic category: speculation.workloads.classifier). Compared, on the same requests:
- best single: the one (candidate, K) with the best mean over all requests (in hindsight);
- oracle: per workload, the (candidate, K) with the best mean over that workload's requests (in hindsight).
overall_gain = auto's mean projected multiplier / the best single's; regret = 1 - auto's / the oracle's;
gain_over_best_single_without_hybrids: auto's / the best single candidate's with the hybrids left out of the singles
(what choosing per step between suffix decoding and a draft adds over the best one of them alone). A hybrid's
projection charges the draft's step for the model's drafts only (the lookup's own step, about c 0.005 per drafted
token, is left out).
"""

from __future__ import annotations

import logging
import random
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from speculation import drafting
from speculation.bench.autopairing_store import Measured, dump_measurements, load_measurements
from speculation.bench.eagle import head_step_s
from speculation.drafting.mechanisms import MODEL_WEIGHTS
from speculation.engine import (
    DraftModelProposer,
    GenerationConfig,
    LocalTarget,
    SuffixIndex,
    generate,
)
from speculation.engine.costs import time_draft_step, time_verify
from speculation.engine.eagle import EagleProposer
from speculation.engine.projection import StepCosts
from speculation.engine.sampling import SamplingParams, probs_from_logits
from speculation.limits import DEFAULT_K
from speculation.models import (
    LOOKUP_KINDS,
    DraftKind,
    DraftModel,
    SpeculationPolicy,
)
from speculation.offline.eagle.prompts import read_prompts, spec_bench_path
from speculation.selectors.autopairing import PROD_MIN_REQUESTS, Choice, table_from_rows, workload_choice
from speculation.services.autopairing import AUTO_MIN_REQUESTS, auto_decision
from speculation.worker.candidates import (
    K_RANGE,
    NGRAM,
    SUFFIX,
    Candidate,
    expected_chain_replays,
    expected_hybrid_replays,
    replay,
)
from speculation.worker.paths import resources
from speculation.worker.paths.drafting import teacher_forced_logits
from speculation.worker.sampled import TargetView, draft_pass_probabilities
from speculation.workloads.classifier import classify

logger = logging.getLogger(__name__)

CONTEXT_TOKENS = 64
SAVE_EVERY = 10


def mixed_prompts(*, requests: int, seed: int, code_share: float) -> list[str]:
    """Spec-Bench's prompts (English and its few coding requests) mixed with held-out stdlib code, shuffled."""
    english = [p.text for p in read_prompts(str(spec_bench_path()))]
    code = [p.text for p in read_prompts("stdlib")]
    rng = random.Random(seed)
    rng.shuffle(english)
    rng.shuffle(code)
    n_code = min(len(code), round(requests * code_share))
    chosen = code[:n_code] + english[: requests - n_code]
    rng.shuffle(chosen)
    return chosen


def candidate_costs(
    target_dir: str, candidates: list[Candidate], context: list[int], store: list[list[int]] = ()
) -> dict[str, StepCosts]:
    """Per candidate: the local path's costs (target verification of n tokens; the candidate's draft step). store:
    token sequences a suffix lookup is timed over (the stream's prompts: a store of that size). A lookup's step
    grows with the context it scans, so n-gram and suffix decoding are timed over the longest of them."""
    target = resources.model(target_dir).model
    verify = time_verify(LocalTarget(target), context, [1, 2, 3, 5, 9])
    costs: dict[str, StepCosts] = {}
    model_steps: dict[str, float] = {}  # per draft directory: a draft and its hybrid share one timing
    for candidate in candidates:
        mechanism = drafting.for_kind(candidate.kind)
        drafts_with_a_model = mechanism.weights == MODEL_WEIGHTS  # a draft model, or the hybrid's fallback
        if drafts_with_a_model and candidate.draft.path in model_steps:
            step = model_steps[candidate.draft.path]
        elif mechanism.reads_target_features:  # an EAGLE head's step: the head's layer + the target's LM head
            head = resources.eagle_head(candidate.draft.path, target_dir=target_dir)
            step = head_step_s(EagleProposer(head, target), context)
        else:
            if drafts_with_a_model:  # a hybrid's model steps cost the draft's
                draft = resources.model(candidate.draft.path)
                shared = resources.shared_vocab(draft, target.vocab_size)  # a draft padded to another size
                proposer = DraftModelProposer(draft.model, target_vocab_size=target.vocab_size, shared_vocab=shared)
            else:  # n-gram lookup, or suffix decoding over the store
                index = SuffixIndex()
                for i, tokens in enumerate(store):
                    index.add(f"s{i}", tokens)
                proposer = mechanism.lookup(index)
            lookup_context = max(store, key=len, default=context) if mechanism.looks_up else context
            step = time_draft_step(proposer, lookup_context or context)
            if drafts_with_a_model:
                model_steps[candidate.draft.path] = step
        costs[candidate.name] = StepCosts(target_step_s=verify[1], draft_step_s=step, verify_s=verify)
    return costs


def measure(
    *,
    target_dir: str,
    candidates: list[Candidate],
    prompts: list[str],
    max_tokens: int,
    save: Path | None = None,
    shard: tuple[int, int] = (0, 1),
    sampling: SamplingParams | None = None,
) -> tuple[list[Measured], dict[str, StepCosts]]:
    """Every request measured, or shard (i, n)'s: the prompts at places i, i + n, ... (`save`: the figures so far
    written there every SAVE_EVERY requests and at the end, so a run cut short still leaves its requests).
    sampling: the target samples each answer (seeded by its place in the stream) and the candidates are replayed
    as shadow replays sampled requests (speculation.worker.candidates: the lookups exactly, a draft, its hybrid and
    an EAGLE head's chain in expectation, with the target's exact distribution)."""
    loaded = resources.model(target_dir)
    target = LocalTarget(loaded.model)
    encoded = [loaded.tokenizer(p)["input_ids"][-(loaded.model.max_len - max_tokens - 1) :] for p in prompts]
    costs = candidate_costs(target_dir, candidates, encoded[0][:CONTEXT_TOKENS] or [1], store=encoded)
    kinds = {c.name: c.kind for c in candidates}
    measured: list[Measured] = []
    answers = SuffixIndex()  # suffix decoding's store: the answers before this request in the stream (this shard's)
    mine = range(shard[0], len(prompts), shard[1])
    for index in mine:
        prompt, prompt_ids = prompts[index], encoded[index]
        config = GenerationConfig(max_new_tokens=max_tokens)
        if sampling is not None:
            config = GenerationConfig(
                max_new_tokens=max_tokens,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                seed=index,
            )
        output = generate(target, None, prompt_ids, config).tokens
        view = None
        if sampling is not None:  # the target's side once for every candidate, exact (as a policy's target_path)
            logits = teacher_forced_logits(loaded.model, prompt_ids, output)
            view = TargetView(params=sampling, p=probs_from_logits(logits, sampling))
        mult, tau, drafts, per_pass, model_steps = {}, {}, {}, {}, {}
        passes_by_draft: dict[str, Any] = {}
        for candidate in candidates:
            mechanism = drafting.for_kind(candidate.kind)
            lookup = mechanism.lookup(answers)  # suffix decoding's over the stream's earlier answers
            if view is not None and mechanism.reads_target_features:  # an EAGLE head's sampled chain, in expectation
                per_k = expected_chain_replays(
                    view, candidate.draft.path, target_path=target_dir, prompt_ids=prompt_ids, output_ids=output,
                    max_tokens=max_tokens, ks=K_RANGE,
                )  # fmt: skip
            elif view is not None and mechanism.weights == MODEL_WEIGHTS:  # a draft and its hybrid: one pass
                if candidate.draft.path not in passes_by_draft:
                    found = draft_pass_probabilities(view, candidate.draft.path, prompt_ids, output)
                    passes_by_draft[candidate.draft.path] = found.per_position
                passes = passes_by_draft[candidate.draft.path]
                per_k = expected_hybrid_replays(
                    lookup, passes.tolist(),
                    prompt_ids + output, K_RANGE, prompt_len=len(prompt_ids), max_new_tokens=max_tokens,
                )  # fmt: skip
            else:
                per_k = replay(
                    candidate,
                    prompt_ids=prompt_ids,
                    output_ids=output,
                    max_tokens=max_tokens,
                    target_path=target_dir,
                    lookup=lookup,
                )
            for k, stats in per_k.items():
                key = (candidate.name, k)
                k_mean = stats.drafted_tokens / stats.target_passes if stats.target_passes else 0.0
                per_pass[key], model_steps[key] = stats.tokens_per_pass, stats.model_steps_per_pass
                mult[key] = costs[candidate.name].multiplier(
                    tokens_per_step=per_pass[key], k=k_mean, draft_steps=model_steps[key]
                )  # per target pass, steps that drafted nothing included; a hybrid's lookups cost no draft step
                tau[key] = stats.mean_accepted_len or 1.0
                drafts[key] = k_mean
        measured.append(
            Measured(classify(prompt), mult, tau, kinds=kinds, k_mean=drafts, index=index, per_pass=per_pass,
                     model_steps=model_steps)
        )  # fmt: skip
        answers.add(f"r{index}", output)
        if len(measured) % SAVE_EVERY == 0 or len(measured) == len(mine):
            logger.info("measured %d of %d requests", len(measured), len(mine))
            if save is not None:
                dump_measurements(save, measured, costs)
    return measured, costs


def _policy(choice: Choice) -> SpeculationPolicy:
    """An unsaved policy holding a pairing (what auto_decision reads: mechanism, draft name, K)."""
    mechanism = drafting.for_kind(choice.kind)
    name = mechanism.draft_name(choice.candidate)
    draft = None if mechanism.looks_up else DraftModel(name=name, kind=mechanism.draft_kind)
    return SpeculationPolicy(mechanism=choice.kind, draft=draft, k=choice.k)


def simulate(measured: list[Measured], *, first: tuple[str, int]) -> list[tuple[str, int]]:
    """The (candidate, K) auto-pairing uses on each request, learnt from the requests before it only, by the
    product's rule (workload_choice over the table; the policy's pairing moved by auto_decision)."""
    rows: list[dict[str, Any]] = []
    kinds = measured[0].kinds if measured else {}
    name, k = first
    current = Choice(name, kinds.get(name, name if name in LOOKUP_KINDS else DraftKind.DRAFT_MODEL), None, k, "",
                     from_evidence=False)  # fmt: skip
    chosen = []
    for i, request in enumerate(measured):
        table = table_from_rows(rows)
        recommendation, _why = auto_decision(policy=_policy(current), table=table)
        if recommendation is not None:
            current = replace(current, candidate=recommendation.candidate, kind=recommendation.kind,
                              k=recommendation.k)  # fmt: skip
        choice = workload_choice(table, workload=request.workload, current=current)
        chosen.append((choice.candidate, choice.k))
        rows += request.rows(request_id=f"r{i}")
    return chosen


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def report(measured: list[Measured], chosen: list[tuple[str, int]]) -> dict[str, Any]:
    keys = list(measured[0].multiplier)
    totals = {key: sum(r.multiplier[key] for r in measured) for key in keys}
    best_single = max(keys, key=lambda key: (totals[key], -key[1]))
    workloads: dict[str, Any] = {}
    auto_all, oracle_all = [], []
    oracles: dict[str, tuple[str, int]] = {}
    by_workload: dict[str, list[int]] = defaultdict(list)
    for i, request in enumerate(measured):
        by_workload[request.workload].append(i)
    for workload, idx in sorted(by_workload.items(), key=lambda t: -len(t[1])):
        rows = [measured[i] for i in idx]
        oracle = oracles[workload] = max(keys, key=lambda key: (sum(r.multiplier[key] for r in rows), -key[1]))
        auto = [measured[i].multiplier[chosen[i]] for i in idx]
        auto_tau = [measured[i].tokens_per_step[chosen[i]] for i in idx]
        auto_all += auto
        oracle_all += [r.multiplier[oracle] for r in rows]
        singles = {
            f"{name}@K{k}": round(_mean([r.multiplier[(name, k)] for r in rows]), 4)
            for name, k in keys
            if k in (1, 3, 5, 8)
        }
        workloads[workload] = {
            "requests": len(rows),
            "auto_projected": round(_mean(auto), 4),
            "auto_mean_accepted_len": round(_mean(auto_tau), 4),
            "best_single_projected": round(_mean([r.multiplier[best_single] for r in rows]), 4),
            "best_single_mean_accepted_len": round(_mean([r.tokens_per_step[best_single] for r in rows]), 4),
            "oracle_projected": round(_mean([r.multiplier[oracle] for r in rows]), 4),
            "oracle": f"{oracle[0]}@K{oracle[1]}",
            "singles": singles,
        }
    auto_overall = _mean(auto_all)
    single_overall = _mean([r.multiplier[best_single] for r in measured])
    # the best fixed choice among the candidates alone (each draft model behind suffix decoding left out)
    kinds = measured[0].kinds
    plain_keys = [key for key in keys if kinds.get(key[0]) != DraftKind.SUFFIX_DRAFT]
    best_plain = max(plain_keys, key=lambda key: (totals[key], -key[1]))
    plain_overall = _mean([r.multiplier[best_plain] for r in measured])
    return {
        "workloads": workloads,
        "best_single": f"{best_single[0]}@K{best_single[1]}",
        "auto_overall_projected": round(auto_overall, 4),
        "best_single_overall_projected": round(single_overall, 4),
        "oracle_overall_projected": round(_mean(oracle_all), 4),
        "overall_gain": round(auto_overall / single_overall, 4) if single_overall else None,
        "regret": round(1 - auto_overall / _mean(oracle_all), 4) if oracle_all else None,
        "oracle_over_best_single": round(_mean(oracle_all) / single_overall, 4) if single_overall else None,
        "best_single_without_hybrids": f"{best_plain[0]}@K{best_plain[1]}",
        "best_single_without_hybrids_projected": round(plain_overall, 4),
        "gain_over_best_single_without_hybrids": round(auto_overall / plain_overall, 4) if plain_overall else None,
        "second_half": _second_half(measured, chosen, best_single, oracles),
        "requests": len(measured),
    }


def _second_half(
    measured: list[Measured],
    chosen: list[tuple[str, int]],
    single: tuple[str, int],
    oracles: dict[str, tuple[str, int]],
) -> dict[str, Any]:
    """overall_gain and regret over the stream's second half only (the same choices, learnt from every request
    before each one): how auto-pairing does once it has learnt, apart from what learning cost it."""
    late = range(len(measured) // 2, len(measured))
    auto = _mean([measured[i].multiplier[chosen[i]] for i in late])
    best = _mean([measured[i].multiplier[single] for i in late])
    oracle = _mean([measured[i].multiplier[oracles[measured[i].workload]] for i in late])
    return {
        "requests": len(late),
        "overall_gain": round(auto / best, 4) if best else None,
        "regret": round(1 - auto / oracle, 4) if oracle else None,
    }


def run(
    *,
    target_dir: str,
    draft_dirs: list[str],
    requests: int,
    max_tokens: int,
    seed: int,
    code_share: float,
    eagle_dir: str = "",
    save_measurements: Path | None = None,
    shard: tuple[int, int] = (0, 1),
    hybrids: bool = True,
    sampling: SamplingParams | None = None,
) -> dict[str, Any]:
    candidates = [Candidate(NGRAM, DraftKind.NGRAM), Candidate(SUFFIX, DraftKind.SUFFIX)]
    for directory in draft_dirs:
        name = f"draft:{Path(directory).parent.name}/{Path(directory).name}"
        candidates.append(Candidate(name, DraftKind.DRAFT_MODEL, DraftModel(name=name, path=directory)))
    if hybrids:  # each draft behind suffix decoding, as shadow's candidates
        drafts = [c for c in candidates if c.kind == DraftKind.DRAFT_MODEL]
        hybrid = drafting.for_kind(DraftKind.SUFFIX_DRAFT)
        candidates += [Candidate(hybrid.candidate_name(c.draft), hybrid.kind, c.draft) for c in drafts]
    if eagle_dir:
        name = f"eagle:{Path(eagle_dir).name}"
        candidates.append(Candidate(name, DraftKind.EAGLE_HEAD, DraftModel(name=name, path=eagle_dir)))
    started = time.perf_counter()
    prompts = mixed_prompts(requests=requests, seed=seed, code_share=code_share)
    measured, costs = measure(
        target_dir=target_dir,
        candidates=candidates,
        prompts=prompts,
        max_tokens=max_tokens,
        save=save_measurements,
        shard=shard,
        sampling=sampling,
    )
    result = evaluate(measured, costs)
    result["setup"] = {
        "target": target_dir,
        "max_tokens": max_tokens,
        "seed": seed,
        "code_share": code_share,
        "sampling": None if sampling is None else {"temperature": sampling.temperature, "top_p": sampling.top_p},
        "k_range": [K_RANGE[0], K_RANGE[-1]],
        "prod_min_requests": PROD_MIN_REQUESTS,
        "auto_min_requests": AUTO_MIN_REQUESTS,
        "seconds": round(time.perf_counter() - started, 1),
    }
    return result


def evaluate(measured: list[Measured], costs: dict[str, StepCosts]) -> dict[str, Any]:
    """Simulate auto-pairing on measured requests (the policy starts on the main draft at DEFAULT_K) and report."""
    names = list(measured[0].kinds) or list(dict.fromkeys(name for name, _ in measured[0].multiplier))
    models = [n for n in names if measured[0].kinds.get(n, DraftKind.DRAFT_MODEL) == DraftKind.DRAFT_MODEL]
    first = (models or names)[0]  # the main draft
    k = (
        DEFAULT_K
        if (first, DEFAULT_K) in measured[0].multiplier
        else min(k for n, k in measured[0].multiplier if n == first)
    )
    chosen = simulate(measured, first=(first, k))
    result = report(measured, chosen)
    result["candidates"] = {name: {"c": round(c.c, 4), "v(K=5)": round(c.v(5), 4)} for name, c in costs.items()}
    return result


def resimulate(paths: list[Path]) -> dict[str, Any]:
    """evaluate() on dump_measurements files (the selection again, nothing measured; shards merged in the
    stream's order, every request's multipliers from the first file's costs)."""
    measured, costs = load_measurements(paths)
    result = evaluate(measured, costs)
    result["setup"] = {"measurements": [str(p) for p in paths], "prod_min_requests": PROD_MIN_REQUESTS,
                       "auto_min_requests": AUTO_MIN_REQUESTS}  # fmt: skip
    return result
