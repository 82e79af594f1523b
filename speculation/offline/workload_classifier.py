"""Train and evaluate the workload classifier on Spec-Bench's labelled prompts (offline; no torch).

    python -m speculation.offline.workload_classifier [--questions PATH] [--json PATH] [--write-model]

A stratified split per Spec-Bench category (seeded): HOLDOUT of each category is held out, the model is trained
on the rest and the held-out accuracy (overall and per workload category) is printed as JSON. --write-model
stores the model trained on the training split (so the reported accuracy is the stored model's) in
speculation/workloads/classifier.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path

from speculation.offline.eagle.prompts import Prompt, read_prompts, spec_bench_path
from speculation.workloads.classifier import CATEGORY_OF, MODEL_PATH, NaiveBayes, classify, features

HOLDOUT = 0.3
SMOOTHING = 0.5  # Lidstone's add-alpha over the vocabulary
MIN_COUNT = 2  # tokens seen fewer times in training are left out of the model (keeps the JSON small)
DIGITS = 3


def split(rows: list[Prompt], *, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held out): HOLDOUT of every Spec-Bench category held out (at least one; a seeded shuffle)."""
    by_category: dict[str, list[Prompt]] = defaultdict(list)
    for row in rows:
        by_category[row.category].append(row)
    rng = random.Random(seed)
    train, held = [], []
    for category in sorted(by_category):
        items = list(by_category[category])
        rng.shuffle(items)
        n_held = max(1, round(len(items) * HOLDOUT))
        held += items[:n_held]
        train += items[n_held:]
    return train, held


def train(rows: list[Prompt]) -> NaiveBayes:
    counts: dict[str, Counter] = defaultdict(Counter)
    docs = Counter()
    for row in rows:
        label = CATEGORY_OF[row.category]
        docs[label] += 1
        counts[label].update(features(row.text))
    total_counts = Counter()
    for counter in counts.values():
        total_counts.update(counter)
    vocab = sorted(token for token, n in total_counts.items() if n >= MIN_COUNT)
    priors, unseen, log_probs = {}, {}, defaultdict(dict)
    n_docs = sum(docs.values())
    for label in sorted(counts):
        denominator = sum(counts[label][t] for t in vocab) + SMOOTHING * len(vocab)
        priors[label] = round(math.log(docs[label] / n_docs), DIGITS)
        unseen[label] = round(math.log(SMOOTHING / denominator), DIGITS)
        for token in vocab:
            if counts[label][token]:
                log_probs[token][label] = round(math.log((counts[label][token] + SMOOTHING) / denominator), DIGITS)
    return NaiveBayes(priors=priors, log_probs=dict(log_probs), unseen=unseen)


def evaluate(nb: NaiveBayes, rows: list[Prompt]) -> dict:
    right: Counter = Counter()
    seen: Counter = Counter()
    confusion: dict[str, Counter] = defaultdict(Counter)
    for row in rows:
        truth = CATEGORY_OF[row.category]
        guess = classify(row.text, nb=nb)
        seen[truth] += 1
        right[truth] += guess == truth
        confusion[truth][guess] += 1
    return {
        "accuracy": round(sum(right.values()) / max(1, len(rows)), 4),
        "held_out": len(rows),
        "per_category": {
            label: {
                "accuracy": round(right[label] / seen[label], 4),
                "n": seen[label],
                "guesses": dict(confusion[label]),
            }
            for label in sorted(seen)
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=Path, default=None, help="Spec-Bench questions (default: the vendored)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the evaluation here too")
    parser.add_argument("--write-model", action="store_true", help=f"store the trained model in {MODEL_PATH}")
    args = parser.parse_args(argv)
    path = args.questions or spec_bench_path()
    rows = read_prompts(str(path))
    train_rows, held = split(rows, seed=args.seed)
    nb = train(train_rows)
    report = {"questions": path.name, "seed": args.seed, "train": len(train_rows)}
    report |= evaluate(nb, held)
    report["vocabulary"] = len(nb.log_probs)
    if args.write_model:
        MODEL_PATH.write_text(json.dumps(nb.to_json(), sort_keys=True, separators=(",", ":")) + "\n")
    text = json.dumps(report, indent=2)
    sys.stdout.write(text + "\n")
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
