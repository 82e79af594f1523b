"""``python -m speculation.bench.batching``: the worker's continuous batching on the demo pair, engine level.

For 1, 8 and 32 concurrent requests (the same prompts: Spec-Bench questions and held-out stdlib code, greedy):
aggregate tok/s of the BatchDecoder (speculation.engine.batch) with the draft model at fixed K = 5, with the
load-aware K (which may choose K = 0), and at K = 0 (plain batched decoding); against serving the same requests
one after another with the single-stream loop (engine.generate, K = 5 and plain), which is what a worker did
before batching. With the load-aware K too: suffix decoding (K up to 8) and the hybrid of suffix decoding with the
draft model's fallback (the draft's K up to 5, the lookup's up to 8), both over a warm store: the target's answers
to other Spec-Bench questions (none of the benchmark's prompts), as an endpoint's store holds earlier traffic.
Every batched output is checked token-identical to plain decoding of its request alone.
Prints a table and writes JSON (``--json PATH``); ``--quick`` runs fewer tokens.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from speculation.bench.engine import DEFAULT_QUESTIONS, load_prompts
from speculation.engine import (
    HYBRID_LOOKUP_K,
    BatchDecoder,
    DraftModelProposer,
    GenerationConfig,
    LoadAwareLookahead,
    LocalTarget,
    SuffixIndex,
    SuffixProposer,
    Transformer,
    generate,
    generate_plain,
    load_causal_lm,
)
from speculation.offline.demo import ensure_demo_pair

K = 5
CONCURRENCY = (1, 8, 32)
VARIANTS = ("k5", "load_aware", "plain", "suffix", "hybrid")
STORE_QUESTIONS = 3  # per category, after the benchmark's own: the warm store's answers
LOOKUP_VARIANTS = {"suffix": (None, HYBRID_LOOKUP_K), "hybrid": ("draft", K)}  # (the draft, K) over the store


def run_batched(
    target: Transformer,
    draft: Transformer,
    prompts: list[list[int]],
    variant: str,
    max_new: int,
    store: SuffixIndex | None = None,
) -> dict:
    """All prompts joined at once; -> aggregate tok/s, tokens per request, how often each K was drafted."""
    k = K if variant != "plain" else 1  # K = 1 is not drafted: the plain variant has no draft model
    drafter = draft if variant in ("k5", "load_aware") else None
    lookup = None
    if variant in LOOKUP_VARIANTS:
        with_draft, k = LOOKUP_VARIANTS[variant]
        drafter = draft if with_draft else None
        lookup = SuffixProposer(store if store is not None else SuffixIndex())
    decoder = BatchDecoder(
        target,
        slots=len(prompts),
        draft=drafter,
        ngram=lookup,
        lookahead=LoadAwareLookahead(k_start=k) if variant in ("load_aware", *LOOKUP_VARIANTS) else None,
        max_context=target.max_len,
    )
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        decoder.add(i, prompt, GenerationConfig(max_new_tokens=max_new, k=k))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    drafted: Counter = Counter()
    looked_up = drafted_tokens = accepted = 0
    while len(decoder):
        updates = decoder.step()
        drafted[max((u.drafted for u in updates), default=0)] += 1
        for update in updates:
            out[update.key] += update.tokens
            drafted_tokens += update.drafted
            accepted += update.accepted
            looked_up += update.drafted if update.looked_up else 0
    elapsed = time.perf_counter() - started
    tokens = sum(len(ids) for ids in out.values())
    return {
        "tok_s": tokens / elapsed,
        "tokens": tokens,
        "outputs": out,
        "k_steps": dict(sorted(drafted.items())),
        "drafted_tokens": drafted_tokens,
        "accepted_tokens": accepted,
        "looked_up_tokens": looked_up,
    }


def warm_store(target: Transformer, tokenizer, questions: Path, skip: int, max_new: int) -> SuffixIndex:
    """The target's greedy answers to STORE_QUESTIONS questions per category after the first `skip` (the
    benchmark's own): what an endpoint's store holds after earlier, different traffic."""
    by_category: dict[str, list[str]] = {}
    with questions.open() as handle:
        for line in handle:
            row = json.loads(line)
            by_category.setdefault(row["category"], []).append(row["turns"][0])
    index = SuffixIndex()
    local = LocalTarget(target)
    for category in sorted(by_category):
        for j, text in enumerate(by_category[category][skip : skip + STORE_QUESTIONS]):
            prompt = tokenizer.encode(text).ids[:256]
            answer = generate_plain(local, prompt, GenerationConfig(max_new_tokens=max_new)).tokens
            index.add(f"{category}-{j}", answer)
    return index


def run_sequential(target: Transformer, draft: Transformer | None, prompts: list[list[int]], max_new: int) -> dict:
    """The same requests one after another through the single-stream loop (a worker without batching)."""
    local = LocalTarget(target)
    started = time.perf_counter()
    outputs = {}
    for i, prompt in enumerate(prompts):
        proposer = DraftModelProposer(draft, target_vocab_size=target.vocab_size) if draft is not None else None
        outputs[i] = generate(local, proposer, prompt, GenerationConfig(max_new_tokens=max_new, k=K)).tokens
    elapsed = time.perf_counter() - started
    tokens = sum(len(ids) for ids in outputs.values())
    return {"tok_s": tokens / elapsed, "tokens": tokens, "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speculation.bench.batching", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 new tokens per request instead of 96")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: best on a shared CPU)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per request (default 32 quick, 96 full)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer

    pair = ensure_demo_pair()
    tokenizer = Tokenizer.from_file(str(pair.target_dir / "tokenizer.json"))
    max_new = args.max_new_tokens or (32 if args.quick else 96)
    pool = [p.ids for p in load_prompts(tokenizer, DEFAULT_QUESTIONS, per_category=3, code_prompts=6)]
    target = load_causal_lm(pair.target_dir, max_len=1024)
    draft = load_causal_lm(pair.draft_dir, max_len=1024)
    store = warm_store(target, tokenizer, DEFAULT_QUESTIONS, skip=3, max_new=max_new)
    results: dict[str, dict] = {}
    for n in CONCURRENCY:
        prompts = [pool[i % len(pool)] for i in range(n)]
        plain_alone = run_sequential(target, None, prompts, max_new)
        row = {"sequential_plain": plain_alone, "sequential_k5": run_sequential(target, draft, prompts, max_new)}
        for variant in VARIANTS:
            row[variant] = run_batched(target, draft, prompts, variant, max_new, store=store)
            row[variant]["identical_to_plain_alone"] = row[variant]["outputs"] == plain_alone["outputs"]
        results[str(n)] = row
        print_row(n, row)
    report = {
        "command": "python -m speculation.bench.batching " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {args.threads}",
        "load_avg": os.getloadavg()[0],
        "demo": pair.target_dir.parent.name,
        "max_new_tokens": max_new,
        "store_answers": len(store),
        "concurrency": {
            n: {name: {k: v for k, v in r.items() if k != "outputs"} for name, r in row.items()}
            for n, row in results.items()
        },
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(row[v]["identical_to_plain_alone"] for row in results.values() for v in VARIANTS) else 1


def print_row(n: int, row: dict) -> None:
    cells = "  ".join(f"{name} {r['tok_s']:7.1f}" for name, r in row.items())
    same = all(row[v]["identical_to_plain_alone"] for v in VARIANTS)
    k_steps = row["load_aware"]["k_steps"]
    hybrid = row["hybrid"]
    looked = hybrid["looked_up_tokens"] / hybrid["drafted_tokens"] if hybrid["drafted_tokens"] else 0.0
    print(
        f"{n:>3} requests  tok/s: {cells}  identical: {same}  load-aware K steps: {k_steps}  "
        f"hybrid: {looked:.0%} of drafts looked up",
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
