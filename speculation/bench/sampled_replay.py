"""``python -m speculation.bench.sampled_replay``: does shadow predict prod on sampled traffic?

Sampled requests (temperature 0.7, top_p 0.9, a seed each) on the demo pair, through the engine's single-stream loop
as prod's local path runs them, with each mechanism: n-gram lookup and suffix decoding (K = 5), the draft model
(K = 3) and the hybrid (suffix decoding with the draft's fallback at the draft's K = 2). Suffix decoding's store
holds the target's answers to other Spec-Bench questions (speculation.bench.batching.warm_store). On each run's
own output the shadow replay predicts the run's target passes:

- a lookup: the replay against the sampled output (exact run by run);
- the hybrid and the draft model: ``expected_hybrid`` with the draft's probability of passing given each sampled
  token, min(1, q(o) / p(o)) (exact in expectation);
- the draft model also by the i.i.d. formula over the mean sum_x min(p, q) (what shadow recorded for a draft model
  alone before), to compare;
- with ``--eagle-head DIR``, an EAGLE head's chain (K = 3) too: each draft passing with min(1, q(o) / p(o)), q the
  head's chain from that step's start (speculation.engine.eagle.chain_logits_along).

Per mechanism: tokens per target pass measured and predicted, their ratio over all requests (1.0: no bias), and the
mean absolute error per request. Prints a table and writes JSON (``--json PATH``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speculation import drafting
from speculation.bench.batching import warm_store
from speculation.bench.engine import DEFAULT_QUESTIONS, load_prompts
from speculation.engine import (
    HYBRID_LOOKUP_K,
    HYBRID_MIN_LOOKUP,
    DraftModelProposer,
    GenerationConfig,
    HybridProposer,
    LocalTarget,
    expected_hybrid,
    generate,
    load_causal_lm,
    replay_proposer,
)
from speculation.engine.acceptance import pass_given_tokens
from speculation.engine.eagle import EagleProposer
from speculation.engine.projection import expected_tokens
from speculation.engine.sampling import SamplingParams, probs_from_logits
from speculation.kinds import DraftKind
from speculation.offline.demo import ensure_demo_pair

SAMPLING = SamplingParams(temperature=0.7, top_p=0.9)
LOOKUP_K, DRAFT_K, HYBRID_K = 5, 3, 2
MECHANISMS = ("ngram", "suffix", "draft", "hybrid")


@torch.inference_mode()
def probabilities(target, draft, sequence: list[int], prompt_len: int) -> tuple[list[float], list[float]]:
    """Per output position: the draft's probability of passing given the sampled token, min(1, q(o) / p(o)), and
    the average over tokens, sum_x min(p, q)."""
    p, tokens = target_probs(target, sequence, prompt_len), torch.tensor(sequence[prompt_len:])
    q = probs_from_logits(draft(torch.tensor(sequence[:-1]), 0).logits[prompt_len - 1 :].float(), SAMPLING)
    per_token, average = pass_given_tokens(p, q, tokens)
    return per_token.tolist(), average.tolist()


def target_probs(target, sequence: list[int], prompt_len: int) -> torch.Tensor:
    """[n, V] the target's processed distribution at the output positions, teacher forced."""
    return probs_from_logits(target(torch.tensor(sequence[:-1]), 0).logits[prompt_len - 1 :].float(), SAMPLING)


@torch.inference_mode()
def chain_passes(target, head, sequence: list[int], prompt_len: int, depth: int) -> list[list[float]]:
    """Per step start i, the head's j-th draft's probability of passing given the sampled tokens."""
    from speculation.engine.eagle import chain_pass_probabilities

    hidden = target(torch.tensor(sequence), 0, return_hidden=EagleProposer(head, target).wants_hidden).hidden
    p = target_probs(target, sequence, prompt_len)
    return chain_pass_probabilities(
        head, target, sequence, hidden, prompt_len=prompt_len, depth=depth, p=p, params=SAMPLING
    )


KINDS = {
    "ngram": DraftKind.NGRAM,
    "suffix": DraftKind.SUFFIX,
    "draft": DraftKind.DRAFT_MODEL,
    "hybrid": DraftKind.SUFFIX_DRAFT,
    "eagle": DraftKind.EAGLE_HEAD,
}  # this benchmark's names for the mechanisms


@dataclass
class _Plan:
    """One sampled request of one mechanism: its proposer and K, and shadow's prediction on the run's output."""

    proposer: Any
    k: int
    predict: Callable[[list[int], int, dict], tuple[float, float]]  # (sequence, n, common) -> passes, i.i.d.'s or 0


class _Plans:
    """How each mechanism runs here and how shadow predicts it (speculation.drafting.Measure)."""

    def __init__(self, target, draft, head, lookup) -> None:
        self.target, self.draft, self.head, self.found = target, draft, head, lookup

    def lookup(self) -> _Plan:
        found = self.found
        return _Plan(
            found, LOOKUP_K, lambda seq, n, common: (replay_proposer(found, seq, LOOKUP_K, **common).target_passes, 0.0)
        )

    def eagle(self) -> _Plan:
        def predict(sequence: list[int], n: int, common: dict) -> tuple[float, float]:
            chains = chain_passes(self.target, self.head, sequence, common["prompt_len"], DRAFT_K)
            stats = expected_hybrid(
                None, [0.0] * n, sequence, DRAFT_K, lookup_k=DRAFT_K, min_lookup=1, chains=chains, **common
            )
            return stats.target_passes, 0.0

        return _Plan(EagleProposer(self.head, self.target), DRAFT_K, predict)

    def draft_model(self) -> _Plan:  # as the hybrid with a lookup that is never used
        return _Plan(self._model(), DRAFT_K, self._expected(None, DRAFT_K, DRAFT_K, HYBRID_LOOKUP_K + 1, iid=True))

    def hybrid(self) -> _Plan:
        proposer = HybridProposer(self.found, self._model(), model_k=HYBRID_K, min_lookup=HYBRID_MIN_LOOKUP)
        return _Plan(
            proposer, HYBRID_LOOKUP_K, self._expected(self.found, HYBRID_K, HYBRID_LOOKUP_K, HYBRID_MIN_LOOKUP)
        )

    def _model(self) -> DraftModelProposer:
        return DraftModelProposer(self.draft, target_vocab_size=self.target.vocab_size)

    def _expected(self, found, model_k: int, k: int, min_lookup: int, *, iid: bool = False) -> Callable:
        def predict(sequence: list[int], n: int, common: dict) -> tuple[float, float]:
            per_token, average = probabilities(self.target, self.draft, sequence, common["prompt_len"])
            looked = (lambda m, d: found.lookup(sequence[:m], d)) if found is not None else None
            stats = expected_hybrid(looked, per_token, sequence, model_k, lookup_k=k, min_lookup=min_lookup, **common)
            if not iid:
                return stats.target_passes, 0.0
            alpha = sum(average) / len(average) if average else 0.0  # the i.i.d. formula predicts a draft alone
            return stats.target_passes, n / expected_tokens(alpha=alpha, k=model_k)

        return predict


def run(target, draft, store, prompts: list[list[int]], mechanism: str, max_new: int, head=None) -> dict:
    local = LocalTarget(target)
    kind = drafting.for_kind(KINDS[mechanism])
    measured, predicted, iid, errors, tokens = 0.0, 0.0, 0.0, [], 0
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        plan = kind.measured_by(_Plans(target, draft, head, kind.lookup(store)))
        config = GenerationConfig(max_new_tokens=max_new, k=plan.k, temperature=0.7, top_p=0.9, seed=i)
        result = generate(local, plan.proposer, prompt, config)
        sequence, n = prompt + result.tokens, len(result.tokens)
        passes, iid_passes = plan.predict(sequence, n, {"prompt_len": len(prompt), "max_new_tokens": max_new})
        iid += iid_passes
        measured += result.stats.target_passes
        predicted += passes
        errors.append(abs(passes - result.stats.target_passes) / max(result.stats.target_passes, 1))
        tokens += n
    row = {
        "requests": len(prompts),
        "tokens": tokens,
        "seconds": round(time.perf_counter() - started, 1),
        "measured_tokens_per_pass": round(tokens / measured, 4),
        "predicted_tokens_per_pass": round(tokens / predicted, 4),
        "predicted_over_measured": round(measured / predicted, 4),  # tokens/pass predicted / measured
        "mean_abs_error_per_request": round(sum(errors) / len(errors), 4),
    }
    if iid:
        row["iid_tokens_per_pass"] = round(tokens / iid, 4)
        row["iid_over_measured"] = round(measured / iid, 4)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m speculation.bench.sampled_replay", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: best on a shared CPU)")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens per request (default 96)")
    parser.add_argument("--per-category", type=int, default=3, help="Spec-Bench questions per category (default 3)")
    parser.add_argument("--eagle-head", type=Path, help="an EAGLE head for the demo target: its chain too")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.per_category < 1:
        parser.error("--max-new-tokens and --per-category must be >= 1")
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer

    pair = ensure_demo_pair()
    tokenizer = Tokenizer.from_file(str(pair.target_dir / "tokenizer.json"))
    prompts = [
        p.ids for p in load_prompts(tokenizer, DEFAULT_QUESTIONS, per_category=args.per_category, code_prompts=6)
    ]
    target = load_causal_lm(pair.target_dir, max_len=1024)
    draft = load_causal_lm(pair.draft_dir, max_len=1024)
    head = None
    if args.eagle_head is not None:
        from speculation.engine.eagle import EagleHead, EagleHeadError

        try:
            head = EagleHead.load(args.eagle_head, target_dir=pair.target_dir).eval()
        except (EagleHeadError, OSError) as exc:
            parser.error(f"--eagle-head: {exc}")
    store = warm_store(target, tokenizer, DEFAULT_QUESTIONS, skip=args.per_category, max_new=args.max_new_tokens)
    results = {}
    heads = ("tokens/pass measured", "predicted", "ratio", "|error|/req", "i.i.d.")
    print(f"{'mechanism':<10} {heads[0]:>21} {heads[1]:>10} {heads[2]:>6} {heads[3]:>11} {heads[4]:>7}")
    for mechanism in MECHANISMS + (("eagle",) if head is not None else ()):
        row = results[mechanism] = run(target, draft, store, prompts, mechanism, args.max_new_tokens, head=head)
        iid = f"{row['iid_tokens_per_pass']:7.3f}" if "iid_tokens_per_pass" in row else f"{'':>7}"
        print(
            f"{mechanism:<10} {row['measured_tokens_per_pass']:>21.3f} {row['predicted_tokens_per_pass']:>10.3f} "
            f"{row['predicted_over_measured']:>6.3f} {row['mean_abs_error_per_request']:>11.3f} {iid}",
            flush=True,
        )
    report = {
        "command": "python -m speculation.bench.sampled_replay " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {args.threads}",
        "demo": pair.target_dir.parent.name,
        "sampling": {"temperature": SAMPLING.temperature, "top_p": SAMPLING.top_p},
        "k": {"lookups": LOOKUP_K, "draft": DRAFT_K, "hybrid_draft": HYBRID_K, "eagle_chain": DRAFT_K},
        "eagle_head": str(args.eagle_head) if head is not None else None,
        "max_new_tokens": args.max_new_tokens,
        "store_answers": len(store),
        "mechanisms": results,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
