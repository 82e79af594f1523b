"""``python -m speculation.bench``: ACE's speculative decoding against plain decoding and Hugging Face.

One process, the same prompts (Spec-Bench questions vendored in speculation/bench/data and held-out stdlib code) and
the demo pair: plain target decoding; ACE speculation with the draft model, with n-gram lookup and with suffix
decoding (its store: the plain answers to the prompts run before, each prompt's own left out), each at K=5 and with
dynamic K; suffix decoding with the draft model's fallback (``suffix_draft``: the draft at K=5, and at K=2, where the
store gives fewer than 3 tokens); Hugging Face transformers ``generate`` plain and with ``assistant_model`` (K=5,
constant schedule, no confidence cut-off: the same drafting as ACE's K=5); and the demo target's EAGLE head as a
chain (``eagle``, K=5 and dynamic K) and as draft trees (``eagle_tree``, shapes in speculation/bench/trees.py): built
first when it is missing (speculation.offline.eagle.demo_head, cached in ``$ACE_HOME/models/<version>-eagle``, a few
minutes once; ``--no-eagle`` skips it). Greedy throughout.
Prints a table and writes JSON (``--json PATH``); ``--quick`` keeps the run under two minutes here. ``--device cuda``
(``--dtype``, default: the loader's, bf16 on CUDA) runs every model there (scripts/device/engine_gpu.sh).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from speculation import drafting
from speculation.bench import trees
from speculation.engine import (
    HYBRID_LOOKUP_K,
    DraftModelProposer,
    DynamicLookahead,
    GenerationConfig,
    HybridProposer,
    LocalTarget,
    SpecStats,
    SuffixIndex,
    SuffixProposer,
    Transformer,
    TreeLookahead,
    generate,
    load_causal_lm,
)
from speculation.engine.eagle import EagleProposer
from speculation.offline.demo import ensure_demo_pair
from speculation.offline.demo.corpus import stdlib_corpus
from speculation.offline.eagle.demo_head import build_demo_head, default_head_dir, eagle_proposer_for
from speculation.offline.eagle.prompts import spec_bench_path

DEFAULT_QUESTIONS = spec_bench_path()
K = 5
TIMING_REPEATS = 30
LOOP_MAX_N = 32  # longest n-gram (tokens) the looping measure looks for
LOOP_COVERAGE = 0.5  # an output loops when one n-gram covers more than this share of it


@dataclass(frozen=True)
class Prompt:
    category: str
    ids: list[int]


@dataclass(frozen=True)
class Mechanism:
    name: str  # "plain" | "draft_model" | "ngram" | "suffix" | "suffix_draft" | "hf_plain" | "hf_assisted" | "eagle"
    # | "eagle_tree"
    k: int | str | None  # eagle_tree: the tree shape's label (speculation/bench/trees.py)


HYBRID_SMALL_K = 2  # the draft's best K behind suffix decoding in bench_autopairing on demo-v10 (docs/BENCHMARKS.md)
MECHANISMS = [
    Mechanism("plain", None),
    Mechanism("draft_model", K),
    Mechanism("draft_model", "dynamic"),
    Mechanism("ngram", K),
    Mechanism("ngram", "dynamic"),
    Mechanism("suffix", K),
    Mechanism("suffix", "dynamic"),
    Mechanism("suffix_draft", K),  # suffix decoding first, the draft model (K) where it finds fewer than 3 tokens
    Mechanism("suffix_draft", HYBRID_SMALL_K),
    Mechanism("hf_plain", None),
    Mechanism("hf_assisted", K),
]


def load_prompts(tokenizer, questions: Path, per_category: int, code_prompts: int) -> list[Prompt]:
    by_category: dict[str, list[str]] = defaultdict(list)
    with questions.open() as handle:
        for line in handle:
            row = json.loads(line)
            by_category[row["category"]].append(row["turns"][0])
    prompts = [
        Prompt(cat, tokenizer.encode(text).ids[:256])
        for cat in sorted(by_category)
        for text in by_category[cat][:per_category]
    ]
    for path in stdlib_corpus().held_out_files[:code_prompts]:  # held out: the pair never trained on them
        text = path.read_text(encoding="utf-8", errors="replace")
        prompts.append(Prompt("code", tokenizer.encode(text).ids[:160]))
    return prompts


@torch.inference_mode()
def step_costs(target: Transformer, draft: Transformer, k: int) -> dict[str, float]:
    """Seconds per call at a mid-context position: target 1 token, target k+1 tokens, draft 1 token."""

    def timed(model: Transformer, n_tokens: int) -> float:
        model.setup_cache(model.max_len)
        device = model.output.weight.device
        tokens = torch.arange(n_tokens, device=device) % model.vocab_size
        model(torch.arange(200, device=device) % model.vocab_size, 0)
        samples = []
        for _ in range(TIMING_REPEATS):
            t0 = time.perf_counter()
            model(tokens, 200).logits.sum().item()  # waits for the device (CUDA runs asynchronously)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    step = timed(target, 1)
    return {"target_step_s": step, "verify_s": timed(target, k + 1), "draft_step_s": timed(draft, 1)}


def repeated_ngram_coverage(tokens: Sequence[Hashable], max_n: int = LOOP_MAX_N) -> float:
    """The largest share of ``tokens`` covered by the occurrences of one n-gram, 1 <= n <= max_n.

    A position is covered by an n-gram g when it lies inside some occurrence of g (occurrences may overlap;
    each position counts once). A greedy repetition loop of period p makes the p-gram at its start cover the
    whole loop. Only n-grams that occur at least twice count (with n <= len/2 a single occurrence cannot
    pass the 0.5 threshold anyway), so a short output that never repeats scores 0.
    """
    total = len(tokens)
    best = 0
    for n in range(1, min(max_n, total // 2) + 1):
        starts: dict[tuple, list[int]] = defaultdict(list)
        for i in range(total - n + 1):
            starts[tuple(tokens[i : i + n])].append(i)
        for positions in starts.values():
            if len(positions) < 2 or len(positions) * n <= best:
                continue
            covered, end = 0, 0
            for i in positions:  # ascending: merge the intervals [i, i + n)
                covered += i + n - max(i, end)
                end = i + n
            best = max(best, covered)
    return best / total if total else 0.0


def looping_share(outputs: list[Sequence[Hashable]]) -> float:
    return round(sum(map(is_looping, outputs)) / len(outputs), 4) if outputs else 0.0


def is_looping(tokens: Sequence[Hashable]) -> bool:
    """The bench's looping criterion: one repeated n-gram (n <= ``LOOP_MAX_N`` tokens) covers more than
    half of the output."""
    return repeated_ngram_coverage(tokens) > LOOP_COVERAGE


LOOKAHEADS: dict[Mechanism, DynamicLookahead] = {}  # dynamic K keeps its estimates across requests, as a server


# Suffix decoding's store: the plain answers to the prompts run so far (each prompt's own left out of its run), as
# an endpoint's store holds its earlier traffic's answers.
ANSWERS = SuffixIndex()


def answer_key(prompt: Prompt) -> str:
    return ",".join(map(str, prompt.ids))


class _Proposers:
    """The proposer and K each mechanism runs with here (speculation.drafting.Measure): suffix decoding over the
    other prompts' plain answers (this prompt's own left out)."""

    def __init__(self, mech: Mechanism, target: LocalTarget, draft: Transformer, prompt: Prompt) -> None:
        self.mech, self.target, self.draft, self.exclude = mech, target, draft, answer_key(prompt)

    def lookup(self) -> tuple[Any, int]:
        return drafting.for_kind(self.mech.name).lookup(ANSWERS, exclude=self.exclude), K

    def draft_model(self) -> tuple[Any, int]:
        return DraftModelProposer(self.draft, target_vocab_size=self.target.vocab_size), K

    def hybrid(self) -> tuple[Any, int]:  # the lookup drafts up to its own cap, the draft model K
        model, _ = self.draft_model()
        lookup = SuffixProposer(ANSWERS, exclude=self.exclude)
        return HybridProposer(lookup, model, model_k=self.mech.k), HYBRID_LOOKUP_K

    def eagle(self) -> tuple[Any, int]:
        raise ValueError("an EAGLE head's runs keep their proposers across requests (main's run)")


def run_ace(mech: Mechanism, target: LocalTarget, draft: Transformer, prompt: Prompt, max_new: int, eos: int):
    config = GenerationConfig(max_new_tokens=max_new, k=K, dynamic_k=mech.k == "dynamic", stop_token_ids=(eos,))
    proposer = None  # plain
    if mech.name != "plain":
        proposer, k = drafting.for_kind(mech.name).measured_by(_Proposers(mech, target, draft, prompt))
        config = replace(config, k=k)
    lookahead = LOOKAHEADS.setdefault(mech, DynamicLookahead(k_max=K, k_start=K)) if config.dynamic_k else None
    result = generate(target, proposer, prompt.ids, config, lookahead=lookahead)
    return result.tokens, result.stats


@torch.inference_mode()
def run_hf(mech: Mechanism, hf_target, hf_draft, prompt: Prompt, max_new: int, eos: int):
    input_ids = torch.tensor([prompt.ids], device=hf_target.device)
    kwargs = dict(
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos,
        attention_mask=torch.ones_like(input_ids),
    )
    if mech.name == "hf_assisted":
        kwargs.update(
            assistant_model=hf_draft,
            num_assistant_tokens=K,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )
    t0 = time.perf_counter()
    out = hf_target.generate(input_ids, **kwargs)
    elapsed = time.perf_counter() - t0
    tokens = out[0, input_ids.shape[1] :].tolist()
    stats = SpecStats(output_tokens=len(tokens), elapsed_s=elapsed)
    return tokens, stats


def summarise(stats: SpecStats) -> dict:
    return {
        "alpha": round(stats.alpha, 4),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_accepted_len": round(stats.mean_accepted_len, 4),
        "tokens_per_pass": round(stats.tokens_per_pass, 4),
        "tok_s": round(stats.tok_s, 2),
        "output_tokens": stats.output_tokens,
        "target_passes": stats.target_passes,
        "elapsed_s": round(stats.elapsed_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speculation.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens (under 2 minutes here)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench questions JSONL")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: best on a shared CPU)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per prompt (default 32 quick, 128 full)")
    parser.add_argument(
        "--demo-version", help="demo pair to benchmark (default: speculation.offline.demo's DEMO_VERSION), e.g. demo-v4"
    )
    parser.add_argument("--draft", default="draft", help="the pair's draft to run (DemoPair.drafts)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), help="default: float32 on CPU, bf16 on CUDA"
    )
    parser.add_argument("--eagle-head", type=Path, help="EAGLE head directory (default: $ACE_HOME/models/<pair>-eagle)")
    parser.add_argument("--no-eagle", action="store_true", help="no EAGLE runs (the demo head is not built either)")
    parser.add_argument(
        "--tree", action="append", metavar="SHAPE",
        help="an EAGLE draft tree to run, k<top_k>-d<depth>-n<nodes>[-t<score temperature>] (repeatable; "
        "default: " + ", ".join(trees.TREES_BY_LABEL) + ")",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        tree_shapes = {trees.tree_label(s): s for s in map(trees.parse_tree, args.tree)} if args.tree else None
    except ValueError as exc:
        parser.error(str(exc))
    if not args.questions.is_file():
        parser.error(f"no Spec-Bench questions at {args.questions} (pass --questions PATH)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    pair = ensure_demo_pair(version=args.demo_version)
    if args.draft not in pair.drafts:
        parser.error(f"{pair.root.name} has no draft {args.draft!r} (it has: {', '.join(pair.drafts)})")
    draft_dir = pair.drafts[args.draft]
    tokenizer = Tokenizer.from_file(str(pair.target_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("</s>")
    max_new = args.max_new_tokens or (32 if args.quick else 128)
    prompts = load_prompts(
        tokenizer, args.questions, per_category=1 if args.quick else 3, code_prompts=1 if args.quick else 6
    )
    dtype = getattr(torch, args.dtype) if args.dtype else None
    target_model = load_causal_lm(pair.target_dir, max_len=1024, device=args.device, dtype=dtype)
    draft_model = load_causal_lm(draft_dir, max_len=1024, device=args.device, dtype=dtype)
    target = LocalTarget(target_model)
    dtype = target_model.output.weight.dtype
    hf_target = LlamaForCausalLM.from_pretrained(pair.target_dir, dtype=dtype).to(args.device).eval()
    hf_draft = LlamaForCausalLM.from_pretrained(draft_dir, dtype=dtype).to(args.device).eval()

    # the demo target's EAGLE head (built once when missing) runs as mechanism "eagle" (a chain) and "eagle_tree"
    if not args.no_eagle and args.eagle_head is None:
        build_demo_head(pair)
    eagle = None if args.no_eagle else eagle_proposer_for(pair, target_model, args.eagle_head)
    eagle_trees = {}
    if eagle is not None:
        eagle_trees = {
            label: EagleProposer(eagle.head, target_model, tree=shape)
            for label, shape in (tree_shapes or trees.TREES_BY_LABEL).items()
        }
        eagle_trees[trees.DYNAMIC] = EagleProposer(eagle.head, target_model, tree=trees.DYNAMIC_TREE)
    depth = trees.DYNAMIC_TREE.depth
    tree_lookahead = TreeLookahead.for_tree(trees.DYNAMIC_TREE, k_max=depth, k_start=depth)  # kept across requests
    # the head's chain at K=5 and with dynamic K (as the draft model runs both)
    mechanisms = MECHANISMS + ([Mechanism("eagle", K), Mechanism("eagle", "dynamic")] if eagle is not None else [])
    mechanisms += [Mechanism("eagle_tree", label) for label in eagle_trees]

    def run(mech: Mechanism, prompt: Prompt):
        if mech.name.startswith("hf_"):
            return run_hf(mech, hf_target, hf_draft, prompt, max_new, eos)
        if mech.name in ("eagle", "eagle_tree"):
            proposer = eagle if mech.name == "eagle" else eagle_trees[mech.k]
            dynamic = mech.k == trees.DYNAMIC
            depth = K if mech.name == "eagle" else proposer.tree.depth
            config = GenerationConfig(max_new_tokens=max_new, k=depth, dynamic_k=dynamic, stop_token_ids=(eos,))
            lookahead = None  # dynamic: kept across requests, as a server keeps it
            if dynamic and mech.name == "eagle":
                lookahead = LOOKAHEADS.setdefault(mech, DynamicLookahead(k_max=K, k_start=K))
            elif dynamic:
                lookahead = tree_lookahead
            result = generate(target, proposer, prompt.ids, config, lookahead=lookahead)
            return result.tokens, result.stats
        return run_ace(mech, target, draft_model, prompt, max_new, eos)

    warm = Prompt(prompts[0].category, prompts[0].ids[:32])
    for mech in mechanisms:  # warm-up: first calls allocate and fill caches
        run(mech, warm)
    costs = step_costs(target_model, draft_model, K)
    target_model.setup_cache(1024)
    draft_model.setup_cache(1024)

    warm_used = tree_lookahead.used

    def run_storing(mech: Mechanism, prompt: Prompt):
        tokens, stats = run(mech, prompt)
        if mech.name == "plain":  # later prompts' suffix runs draft from it (its own run leaves it out)
            ANSWERS.add(answer_key(prompt), tokens)
        return tokens, stats

    results, wall_s = run_interleaved(prompts, mechanisms, run_storing)
    report = build_report(results, costs, prompts, max_new, pair, args)
    report["wall_s"] = wall_s
    print_table(report)
    trees.add_shapes_used(report, {label: n - warm_used[label] for label, n in tree_lookahead.used.items()})
    write_json(report, args.json)
    return 0


Results = dict[Mechanism, list[tuple[Prompt, list[int], SpecStats]]]


def run_interleaved(
    prompts: list[Prompt], mechanisms: list[Mechanism], run: Callable[[Mechanism, Prompt], tuple[list[int], SpecStats]]
) -> tuple[Results, float]:
    """Every mechanism on each prompt in turn, so load changes on the machine hit every mechanism alike."""
    results: Results = defaultdict(list)
    started = time.perf_counter()
    for prompt in prompts:
        for mech in mechanisms:
            tokens, stats = run(mech, prompt)
            results[mech].append((prompt, tokens, stats))
    return results, round(time.perf_counter() - started, 1)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s))"


def write_json(report: dict, path: Path | None) -> None:
    if path:
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")


def build_report(results, costs, prompts, max_new, pair, args) -> dict:
    plain_key, hf_key = Mechanism("plain", None), Mechanism("hf_assisted", K)
    plain_tokens = [tokens for _, tokens, _ in results[plain_key]]
    tok_s = {m: SpecStats.combine([s for _, _, s in rows]).tok_s for m, rows in results.items()}
    # costs measured inside the decode loop of these very runs (the microbenchmark ones are kept as micro_*)
    plain = SpecStats.combine([s for _, _, s in results[plain_key]])
    spec = SpecStats.combine([s for _, _, s in results[Mechanism("draft_model", K)]])
    target_step_s = plain.verify_s / plain.target_passes
    c_draft = spec.draft_s / spec.drafted_tokens / target_step_s
    v_verify = spec.verify_s / spec.target_passes / target_step_s

    def figures(mech: Mechanism, rows) -> dict:
        stats = SpecStats.combine([s for _, _, s in rows])
        entry = {"mechanism": mech.name, "k": mech.k, **summarise(stats)}
        entry["speedup_vs_plain"] = round(stats.tok_s / tok_s[plain_key], 3)
        entry["speedup_vs_hf"] = round(stats.tok_s / tok_s[hf_key], 3)
        if mech.name == "eagle_tree":
            entry.update(trees.tree_entry(mech.k))
        if mech.name in trees.SPECULATIVE:
            entry["greedy_identical"] = [t for _, t, _ in rows] == [plain_tokens[i] for i in range(len(rows))]
        if mech.name == "draft_model" and mech.k == K:
            bound = stats.mean_accepted_len / (v_verify + K * c_draft)
            entry.update(bound=round(bound, 3), efficiency=round(entry["speedup_vs_plain"] / bound, 3))
        return entry

    runs = [figures(m, rows) for m, rows in results.items()]
    main_key = Mechanism("draft_model", K)
    top = next(r for r in runs if r["mechanism"] == "draft_model" and r["k"] == K)
    categories = {}
    for category in sorted({p.category for p in prompts}):
        per_mech = {m: [row for row in rows if row[0].category == category] for m, rows in results.items()}
        spec = SpecStats.combine([s for _, _, s in per_mech[main_key]])
        plain = SpecStats.combine([s for _, _, s in per_mech[plain_key]])
        ngram = SpecStats.combine([s for _, _, s in per_mech[Mechanism("ngram", K)]])
        categories[category] = {
            "prompts": len(per_mech[main_key]),
            "looping_share": looping_share([tokens for _, tokens, _ in per_mech[plain_key]]),
            "alpha": round(spec.alpha, 4),
            "mean_accepted_len": round(spec.mean_accepted_len, 4),
            "speedup_vs_plain": round(spec.tok_s / plain.tok_s, 3),
            "ngram_mean_accepted_len": round(ngram.mean_accepted_len, 4),
            "ngram_speedup_vs_plain": round(ngram.tok_s / plain.tok_s, 3),
            "mechanisms": {
                f"{m.name}:{m.k}": trees.figures(SpecStats.combine([s for _, _, s in rows]), plain)
                for m, rows in per_mech.items()
                if m.name in trees.SPECULATIVE
            },
        }
        if Mechanism("eagle", K) in per_mech:  # additive (eagle)
            eagle = SpecStats.combine([s for _, _, s in per_mech[Mechanism("eagle", K)]])
            categories[category].update(
                eagle_alpha=round(eagle.alpha, 4),
                eagle_mean_accepted_len=round(eagle.mean_accepted_len, 4),
                eagle_speedup_vs_plain=round(eagle.tok_s / plain.tok_s, 3),
            )
    info = pair.build_info
    return {
        "device": device_name(args.device),
        "date": dt.date.today().isoformat(),
        "command": "python -m speculation.bench " + " ".join(sys.argv[1:]),
        "quick": args.quick,
        "prompts": len(prompts),
        "max_new_tokens": max_new,
        "k": K,
        "alpha": top["alpha"],
        "acceptance_rate": top["acceptance_rate"],
        "mean_accepted_len": top["mean_accepted_len"],
        "c_draft": round(c_draft, 4),
        "v_verify": round(v_verify, 4),
        "target_step_ms": round(target_step_s * 1e3, 3),
        "micro_target_step_ms": round(costs["target_step_s"] * 1e3, 3),
        "micro_c_draft": round(costs["draft_step_s"] / costs["target_step_s"], 4),
        "micro_v_verify": round(costs["verify_s"] / costs["target_step_s"], 4),
        "tok_s_plain": round(tok_s[plain_key], 2),
        "tok_s_spec": top["tok_s"],
        "tok_s_hf_assisted": round(tok_s[hf_key], 2),
        "tok_s_hf_plain": round(tok_s[Mechanism("hf_plain", None)], 2),
        "speedup_vs_plain": top["speedup_vs_plain"],
        "speedup_vs_hf": top["speedup_vs_hf"],
        "bound": top["bound"],
        "efficiency": top["efficiency"],
        "greedy_identical": all(r.get("greedy_identical", True) for r in runs),
        "looping_share": looping_share(plain_tokens),
        "looping_definition": (
            f"share of the target's greedy outputs (plain runs) in which the occurrences of one n-gram, "
            f"1 <= n <= {LOOP_MAX_N} tokens, cover more than {LOOP_COVERAGE:.0%} of the output's tokens"
        ),
        "model": {
            "demo_version": pair.root.name,
            "draft": getattr(args, "draft", "draft"),
            "target_params": info.get("target_params"),
            "draft_params": info.get("draft_params"),
            "alpha_heldout_text": info.get("alpha_heldout_text"),
            "alpha_heldout_generated": info.get("alpha_heldout_generated"),
            "eagle_head": trees.head_entry(getattr(args, "eagle_head", None) or default_head_dir(pair)),
        },
        "runs": runs,
        "categories": categories,
        "eagle_vs_draft": trees.eagle_vs_draft(runs, categories, f"draft_model:{K}"),
    }


def print_table(report: dict) -> None:
    print(f"device: {report['device']}   prompts: {report['prompts']}   max_new_tokens: {report['max_new_tokens']}")
    header = f"{'mechanism':<12} {'k':>16} {'tok/s':>8} {'vs plain':>9} {'vs HF':>7} {'alpha':>6} {'E[N]':>6}"
    print(f"{header} {'ident':>6}")
    for r in report["runs"]:
        print(
            f"{r['mechanism']:<12} {r['k']!s:>16} {r['tok_s']:>8.1f} {r['speedup_vs_plain']:>9.2f} "
            f"{r['speedup_vs_hf']:>7.2f} {r['alpha']:>6.2f} {r['mean_accepted_len']:>6.2f} "
            f"{r.get('greedy_identical', '-')!s:>6}"
        )
    print(f"demo pair {report['model']['demo_version']}  looping_share {report['looping_share']}")
    print(
        f"c_draft {report['c_draft']}  v_verify {report['v_verify']}  target_step_ms {report['target_step_ms']}  "
        f"bound {report['bound']}  efficiency {report['efficiency']}"
    )
    for name, cat in report["categories"].items():
        print(
            f"  {name:<15} loops {cat['looping_share']:.2f}  alpha {cat['alpha']:.2f}  "
            f"E[N] {cat['mean_accepted_len']:.2f}  "
            f"speedup {cat['speedup_vs_plain']:.2f}  (n-gram E[N] {cat['ngram_mean_accepted_len']:.2f}, "
            f"speedup {cat['ngram_speedup_vs_plain']:.2f})"
        )
    trees.print_comparison(report)


if __name__ == "__main__":
    raise SystemExit(main())
