"""``python -m speculation.bench.looping``: does the demo target's greedy output loop, and is it text?

Plain greedy decoding only (no speculation, so it is quick even for a wide sample): the target answers
``--per-category`` Spec-Bench questions of every category and ``--code-prompts`` held-out stdlib files (the
prompts of ``python -m speculation.bench``), ``--max-new-tokens`` each. Greedy output of N tokens starts with
the output of fewer, so one run reports ``looping_share`` (speculation.bench.engine's measure) at every length
of ``--lengths``, overall and per category, the share of decoded characters that are not text (U+FFFD from a
broken UTF-8 byte run, or control codes), and the first answers of a few categories as samples.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import defaultdict
from pathlib import Path

import torch

from speculation.bench.engine import DEFAULT_QUESTIONS, is_looping, load_prompts, looping_share
from speculation.engine import GenerationConfig, LocalTarget, generate, load_causal_lm
from speculation.offline.demo import ensure_demo_pair

logger = logging.getLogger(__name__)

SAMPLE_CATEGORIES = ("coding", "writing", "qa", "code")


def garbled_share(text: str) -> float:
    """Share of characters that are U+FFFD (a broken UTF-8 byte run) or control codes other than newline/tab."""
    bad = sum(ch == "\ufffd" or (ord(ch) < 32 and ch not in "\n\t") for ch in text)
    return round(bad / len(text), 4) if text else 0.0


def summarize(outputs: list[tuple[str, list[int]]], lengths: list[int], decode) -> dict:
    """The report of ``outputs`` ([(category, greedy tokens)]): looping per length and category, garbling."""
    report: dict = {"prompts": len(outputs), "looping_share": {}, "per_category": {}}
    for n in lengths:
        report["looping_share"][str(n)] = looping_share([tokens[:n] for _, tokens in outputs])
    by_category: dict[str, list[list[int]]] = defaultdict(list)
    for category, tokens in outputs:
        by_category[category].append(tokens)
    for category, rows in sorted(by_category.items()):
        report["per_category"][category] = {"prompts": len(rows), "looping": sum(map(is_looping, rows))}
    texts = [decode(tokens) for _, tokens in outputs]
    report["garbled_share"] = garbled_share("".join(texts))
    report["samples"] = {}
    for (category, _), text in zip(outputs, texts, strict=True):
        if category in SAMPLE_CATEGORIES and category not in report["samples"]:
            report["samples"][category] = text
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speculation.bench.looping", description=__doc__.splitlines()[0])
    parser.add_argument("--demo-version", help="demo pair (default: speculation.offline.demo's DEMO_VERSION)")
    parser.add_argument("--per-category", type=int, default=3, help="Spec-Bench questions per category")
    parser.add_argument("--code-prompts", type=int, default=3, help="held-out stdlib files")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--lengths", default="32,128", help="output lengths to report looping at (comma list)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    try:
        lengths = sorted({int(n) for n in args.lengths.split(",")})
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if args.per_category < 1 or args.code_prompts < 0 or args.max_new_tokens < 1 or lengths[0] < 1:
        parser.error("--per-category, --max-new-tokens and --lengths must be positive, --code-prompts >= 0")
    torch.set_num_threads(1)
    from tokenizers import Tokenizer

    pair = ensure_demo_pair(version=args.demo_version)
    tokenizer = Tokenizer.from_file(str(pair.target_dir / "tokenizer.json"))
    target = LocalTarget(load_causal_lm(pair.target_dir, max_len=512))
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_token_ids=(tokenizer.token_to_id("</s>"),))
    prompts = load_prompts(tokenizer, DEFAULT_QUESTIONS, args.per_category, args.code_prompts)
    outputs = [(p.category, list(generate(target, None, p.ids, config).tokens)) for p in prompts]
    report = {"demo_version": pair.root.name, "max_new_tokens": args.max_new_tokens}
    report.update(summarize(outputs, [n for n in lengths if n <= args.max_new_tokens], tokenizer.decode))
    print(f"demo pair {report['demo_version']}, {report['prompts']} prompts, garbled {report['garbled_share']}")
    for n, share in report["looping_share"].items():
        print(f"  looping_share at {n} tokens: {share}")
    for category, text in report["samples"].items():
        print(f"  sample ({category}): {text[:240]!r}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
