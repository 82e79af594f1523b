"""``python -m speculation.bench.eagle``: the EAGLE head against the separate draft model and n-gram lookup.

Same process, same prompts and same demo target as ``python -m speculation.bench`` (whose helpers it reuses):
plain target decoding, ACE speculation at K=5 with the draft model, n-gram lookup and the EAGLE head, and
Hugging Face ``assistant_model`` generation with the draft (K=5). Greedy throughout; every speculative output
is checked token-identical to plain decoding. Per Spec-Bench category: alpha, mean accepted length, tok/s,
speedup vs plain and vs HF assisted. The head comes from ``--head`` (default ``$ACE_HOME/models/<demo>-eagle``,
trained there first with ``--train`` if missing).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from speculation.bench import engine as bench
from speculation.engine import GenerationConfig, LocalTarget, SpecStats, generate, load_causal_lm
from speculation.engine.eagle import EagleProposer, greedy_choice
from speculation.offline.demo import ensure_demo_pair
from speculation.offline.eagle.demo_head import default_head_dir, eagle_proposer_for

K = bench.K
MECHANISMS = [
    bench.Mechanism("plain", None),
    bench.Mechanism("draft_model", K),
    bench.Mechanism("ngram", K),
    bench.Mechanism("eagle", K),
    bench.Mechanism("hf_assisted", K),
]
COMPARED = ("eagle", "draft_model", "ngram")


@torch.inference_mode()
def head_step_s(proposer: EagleProposer, prompt_ids: list[int]) -> float:
    """Seconds per EAGLE draft step (the head's layer + the target's LM head): (t(3 drafts) - t(1 draft)) / 2."""
    drafter = proposer.drafter
    hidden = proposer.target_model(torch.tensor(prompt_ids[:-1]), 0, return_hidden=proposer.wants_hidden).hidden
    next_tokens = torch.tensor(prompt_ids[1:])

    def timed(k: int) -> float:
        drafter.reset()
        drafter.observe(hidden, next_tokens)
        t0 = time.perf_counter()
        drafter.draft(k, greedy_choice)
        return time.perf_counter() - t0

    return statistics.median((timed(3) - timed(1)) / 2 for _ in range(bench.TIMING_REPEATS))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speculation.bench.eagle", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--head", type=Path, help="EAGLE head directory (default: the demo target's)")
    parser.add_argument("--questions", type=Path, default=bench.DEFAULT_QUESTIONS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--per-category", type=int, help="Spec-Bench prompts per category (default 1 quick, 3)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    pair = ensure_demo_pair()
    head_dir = args.head or default_head_dir(pair)
    if not (head_dir / "config.json").is_file():
        raise SystemExit(f"no EAGLE head in {head_dir}: train one with `python manage.py train_eagle` (see docs)")
    tokenizer = Tokenizer.from_file(str(pair.target_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("</s>")
    max_new = args.max_new_tokens or (48 if args.quick else 128)
    per_category = args.per_category or (1 if args.quick else 3)
    prompts = bench.load_prompts(tokenizer, args.questions, per_category=per_category,
                                 code_prompts=2 if args.quick else 6)  # fmt: skip
    target_model = load_causal_lm(pair.target_dir, max_len=1024)
    draft_model = load_causal_lm(pair.draft_dir, max_len=1024)
    target = LocalTarget(target_model)
    eagle = eagle_proposer_for(pair, target_model, head_dir)
    hf_target = LlamaForCausalLM.from_pretrained(pair.target_dir, dtype=torch.float32).eval()
    hf_draft = LlamaForCausalLM.from_pretrained(pair.draft_dir, dtype=torch.float32).eval()

    def run(mech: bench.Mechanism, prompt: bench.Prompt):
        if mech.name.startswith("hf_"):
            return bench.run_hf(mech, hf_target, hf_draft, prompt, max_new, eos)
        if mech.name == "eagle":
            config = GenerationConfig(max_new_tokens=max_new, k=K, stop_token_ids=(eos,))
            result = generate(target, eagle, prompt.ids, config)
            return result.tokens, result.stats
        return bench.run_ace(mech, target, draft_model, prompt, max_new, eos)

    for mech in MECHANISMS:  # warm-up
        run(mech, prompts[0])
    costs = bench.step_costs(target_model, draft_model, K)
    target_model.setup_cache(1024)
    draft_model.setup_cache(1024)
    costs["eagle_step_s"] = head_step_s(eagle, prompts[0].ids)

    results, wall_s = bench.run_interleaved(prompts, MECHANISMS, run)
    report = build_report(results, costs, prompts, max_new, head_dir, args)
    report["wall_s"] = wall_s
    print_table(report)
    bench.write_json(report, args.json)
    return 0


def _figures(rows, plain: SpecStats, hf: SpecStats) -> dict:
    stats = SpecStats.combine([s for _, _, s in rows])
    return {
        **bench.summarise(stats),
        "speedup_vs_plain": round(stats.tok_s / plain.tok_s, 3),
        "speedup_vs_hf": round(stats.tok_s / hf.tok_s, 3),
    }


def build_report(results, costs, prompts, max_new, head_dir: Path, args) -> dict:
    by_name = {m.name: rows for m, rows in results.items()}
    plain_tokens = [t for _, t, _ in by_name["plain"]]

    def combined(name: str, category: str | None = None) -> SpecStats:
        return SpecStats.combine([s for p, _, s in by_name[name] if category is None or p.category == category])

    runs = []
    for mech, rows in results.items():
        entry = {"mechanism": mech.name, "k": mech.k, **_figures(rows, combined("plain"), combined("hf_assisted"))}
        if mech.name in COMPARED:
            entry["greedy_identical"] = [t for _, t, _ in rows] == plain_tokens
        runs.append(entry)
    categories = {}
    for category in sorted({p.category for p in prompts}):
        plain, hf = combined("plain", category), combined("hf_assisted", category)
        categories[category] = {
            "prompts": sum(p.category == category for p in prompts),
            **{name: _figures([r for r in by_name[name] if r[0].category == category], plain, hf) for name in COMPARED},
        }
    target_step = costs["target_step_s"]
    head_config = json.loads((head_dir / "config.json").read_text())["ace_eagle"]
    return {
        "device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s))",
        "date": dt.date.today().isoformat(),
        "command": "python -m speculation.bench.eagle " + " ".join(sys.argv[1:]),
        "prompts": len(prompts),
        "max_new_tokens": max_new,
        "k": K,
        "head": {"dir": str(head_dir), **head_config.get("trained", {})},
        "target_step_ms": round(target_step * 1e3, 3),
        "c_draft": round(costs["draft_step_s"] / target_step, 4),
        "c_eagle": round(costs["eagle_step_s"] / target_step, 4),
        "v_verify": round(costs["verify_s"] / target_step, 4),
        "runs": runs,
        "categories": categories,
    }


def print_table(report: dict) -> None:
    print(f"device: {report['device']}   prompts: {report['prompts']}   max_new_tokens: {report['max_new_tokens']}")
    print(f"target step {report['target_step_ms']} ms  c_draft {report['c_draft']}  c_eagle {report['c_eagle']}  "
          f"v_verify {report['v_verify']}")  # fmt: skip
    print(f"{'mechanism':<12} {'k':>4} {'tok/s':>8} {'vs plain':>9} {'vs HF':>7} {'alpha':>6} {'E[N]':>6} {'ident':>6}")
    for r in report["runs"]:
        print(
            f"{r['mechanism']:<12} {r['k']!s:>4} {r['tok_s']:>8.1f} {r['speedup_vs_plain']:>9.2f} "
            f"{r['speedup_vs_hf']:>7.2f} {r['alpha']:>6.2f} {r['mean_accepted_len']:>6.2f} "
            f"{r.get('greedy_identical', '-')!s:>6}"
        )
    for name, cat in report["categories"].items():
        cells = "  ".join(
            f"{m} a={cat[m]['alpha']:.2f} N={cat[m]['mean_accepted_len']:.2f} x{cat[m]['speedup_vs_plain']:.2f}"
            for m in COMPARED
        )
        print(f"  {name:<15} {cells}")


if __name__ == "__main__":
    raise SystemExit(main())
