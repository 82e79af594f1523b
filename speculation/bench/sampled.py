"""``python -m speculation.bench.sampled``: why one sampled stream gains less than one greedy stream (engine level).

One request at a time on the demo pair, greedy and sampled (temperature 0.7, top_p 0.9, as bench_gateway's
concurrency section sends), with the draft model at K = 3 and plain (K = 0), through what the worker's local path
runs: the batch decoder (speculation.engine.batch, ACE_BATCH_SLOTS rows, one of them active) and the single-stream
loop (engine.generate). Per variant: tok/s, draft acceptance (accepted / drafted), tokens per verification step
(bonus included) and wall time per target pass, so that a lower gain is seen to come from acceptance or from the
cost of a step. Prints a table and writes JSON (``--json PATH``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

import torch

from speculation.bench.engine import DEFAULT_QUESTIONS, load_prompts
from speculation.engine import (
    BatchDecoder,
    DraftModelProposer,
    GenerationConfig,
    LocalTarget,
    generate,
    load_causal_lm,
)
from speculation.offline.demo import ensure_demo_pair

K = 3
SAMPLINGS = {"greedy": {}, "sampled": {"temperature": 0.7, "top_p": 0.9}}


def run_batch(target, draft, prompts: list[list[int]], *, slots: int, k: int, sampling: dict, max_new: int) -> dict:
    """Each prompt alone in a batch decoder of `slots` rows (what the worker's batch loop runs for one stream)."""
    decoder = BatchDecoder(target, slots=slots, draft=draft if k else None, max_context=target.max_len)
    tokens = drafted = accepted = steps = 0
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        decoder.add(i, prompt, GenerationConfig(max_new_tokens=max_new, k=k or 1, seed=i, **sampling))
        while len(decoder):
            for update in decoder.step():
                tokens += len(update.tokens)
                drafted += update.drafted
                accepted += update.accepted
            steps += 1
    return _row(tokens, drafted, accepted, steps, time.perf_counter() - started)


def run_single(target, draft, prompts: list[list[int]], *, k: int, sampling: dict, max_new: int) -> dict:
    """Each prompt through the single-stream loop (engine.generate; K = 0: plain decoding)."""
    local = LocalTarget(target)
    tokens = drafted = accepted = steps = 0
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        proposer = DraftModelProposer(draft, target_vocab_size=target.vocab_size) if k else None
        config = GenerationConfig(max_new_tokens=max_new, k=k, seed=i, **sampling)
        stats = generate(local, proposer, prompt, config).stats
        tokens += stats.output_tokens
        drafted += stats.drafted_tokens
        accepted += stats.accepted_tokens
        steps += stats.target_passes
    return _row(tokens, drafted, accepted, steps, time.perf_counter() - started)


def _row(tokens: int, drafted: int, accepted: int, steps: int, elapsed: float) -> dict:
    return {
        "tok_s": round(tokens / elapsed, 2),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "tokens_per_step": round(tokens / steps, 3) if steps else None,
        "ms_per_step": round(elapsed / steps * 1000, 2) if steps else None,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speculation.bench.sampled", description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: best on a shared CPU)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request (default 64)")
    parser.add_argument("--prompts", type=int, default=8, help="requests per variant (default 8)")
    parser.add_argument("--slots", type=int, default=8, help="batch decoder rows (the worker's ACE_BATCH_SLOTS)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer

    pair = ensure_demo_pair()
    tokenizer = Tokenizer.from_file(str(pair.target_dir / "tokenizer.json"))
    prompts = [p.ids for p in load_prompts(tokenizer, DEFAULT_QUESTIONS, per_category=1, code_prompts=2)]
    prompts = prompts[: args.prompts]
    target = load_causal_lm(pair.target_dir, max_len=1024)
    draft = load_causal_lm(pair.draft_dir, max_len=1024)
    run = dict(max_new=args.max_new_tokens)
    results: dict[str, dict] = {}
    with torch.inference_mode():
        for name, sampling in SAMPLINGS.items():
            results[name] = {
                f"batch_k{K}": run_batch(target, draft, prompts, slots=args.slots, k=K, sampling=sampling, **run),
                "batch_k0": run_batch(target, draft, prompts, slots=args.slots, k=0, sampling=sampling, **run),
                f"single_k{K}": run_single(target, draft, prompts, k=K, sampling=sampling, **run),
                "single_k0": run_single(target, draft, prompts, k=0, sampling=sampling, **run),
            }
            for variant, row in results[name].items():
                print(f"{name:8} {variant:9} {json.dumps(row)}", flush=True)
    report = {
        "command": "python -m speculation.bench.sampled " + " ".join(argv or []),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {args.threads}",
        "load_avg": os.getloadavg(),
        "demo": pair.target_dir.parent.name,
        "k": K,
        "results": results,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
