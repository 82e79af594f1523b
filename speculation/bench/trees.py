"""EAGLE draft trees in ``python -m speculation.bench``: the tree shapes run, and EAGLE against the draft model.

Runs named ``mechanism: "eagle_tree"`` carry the shape's label as their ``k`` (``k<top_k>-d<depth>-n<nodes>-t<score
temperature>``) and the shape itself under ``tree``; the run with ``k: "dynamic"`` lets the lookahead controller
(engine.lookahead.TreeLookahead) choose each step's shape among the family of ``DYNAMIC_TREE`` (the chain, the
tree with half its nodes, the tree) and its depth, and says under ``shapes_used`` how many steps each shape ran.
Per category the report gains ``mechanisms`` (every speculative run's alpha, mean accepted length, tok/s and
speedup) and, overall, ``eagle_vs_draft``: the best EAGLE configuration against the draft model at K=5, overall and
per category (and every EAGLE run's under ``configurations``).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

from speculation.engine import SpecStats
from speculation.engine.tree import TreeShape, TreeShapeError

# Shapes for a CPU, where a verification pass costs about one target step per few extra rows: a narrow deep
# tree (two candidates per level) and EAGLE-2's usual wider one. The head trained by train_eagle is
# under-confident (its top-1 is right far more often than its probability says), so scores are sharpened
# (score temperature 0.3) before depth is traded for breadth. The one-wide tree of depth 8 is the control: a
# chain of 8, so the gain of branching is told apart from the gain of drafting deeper than K=5.
EAGLE_TREES = (
    TreeShape(top_k=2, depth=8, nodes=12, score_temperature=0.3),
    TreeShape(top_k=4, depth=6, nodes=24, score_temperature=0.3),
    TreeShape(top_k=1, depth=8, nodes=8),
)
SPECULATIVE = ("draft_model", "ngram", "suffix", "suffix_draft", "eagle", "eagle_tree")
DYNAMIC = "dynamic"  # the eagle_tree run whose shape and depth the controller chooses
DYNAMIC_TREE = EAGLE_TREES[0]  # the policy-default tree it chooses around


def tree_label(shape: TreeShape) -> str:
    return f"k{shape.top_k}-d{shape.depth}-n{shape.nodes}-t{shape.score_temperature:g}"


TREES_BY_LABEL = {tree_label(shape): shape for shape in EAGLE_TREES}
_LABEL = re.compile(r"k(\d+)-d(\d+)-n(\d+)(?:-t(\d+(?:\.\d*)?|\.\d+))?")


def parse_tree(label: str) -> TreeShape:
    """``k<top_k>-d<depth>-n<nodes>[-t<score temperature>]`` (``tree_label``'s form; t defaults to 1) as a shape;
    ValueError saying what is wrong otherwise."""
    match = _LABEL.fullmatch(label.strip())
    if match is None:
        raise ValueError(f"tree {label!r} is not k<top_k>-d<depth>-n<nodes>[-t<score temperature>] (k2-d6-n10-t0.3)")
    top_k, depth, nodes, temperature = match.groups()
    try:
        return TreeShape(top_k=int(top_k), depth=int(depth), nodes=int(nodes),
                         score_temperature=float(temperature) if temperature else 1.0)  # fmt: skip
    except TreeShapeError as exc:
        raise ValueError(f"tree {label!r}: {exc}") from None


def tree_entry(label: str) -> dict:
    """The JSON of a tree run's shape (added to its ``runs`` entry)."""
    return {"tree": asdict(DYNAMIC_TREE if label == DYNAMIC else parse_tree(label))}


def add_shapes_used(report: dict, used: dict[str, int]) -> None:
    """The dynamic run's drafting steps per shape (after the warm-up), in its ``runs`` entry and printed."""
    for run in report["runs"]:
        if run["mechanism"] == "eagle_tree" and run["k"] == DYNAMIC:
            run["shapes_used"] = used
            print(f"eagle_tree dynamic around {tree_label(DYNAMIC_TREE)}: drafting steps per shape {used}")


def head_entry(head_dir: Path) -> dict | None:
    """The EAGLE head a run used: its directory, format, feature layers and training figures (None: no head)."""
    try:
        meta = json.loads((Path(head_dir) / "config.json").read_text())["ace_eagle"]
    except (OSError, ValueError, KeyError):
        return None
    keys = ("format", "feature_layers", "target_name", "trained")
    return {"dir": str(head_dir), **{key: meta.get(key) for key in keys}}


def figures(stats: SpecStats, plain: SpecStats) -> dict:
    return {
        "alpha": round(stats.alpha, 4),
        "mean_accepted_len": round(stats.mean_accepted_len, 4),
        "tok_s": round(stats.tok_s, 2),
        "speedup_vs_plain": round(stats.tok_s / plain.tok_s, 3) if plain.tok_s else 0.0,
    }


def eagle_vs_draft(runs: list[dict], categories: dict[str, dict], draft_key: str) -> dict | None:
    """Every EAGLE run against the draft model at K=5, overall and category by category; ``best`` is the
    fastest one that beats the draft on both mean accepted length and tok/s overall (else the fastest)."""
    draft = next((r for r in runs if f"{r['mechanism']}:{r['k']}" == draft_key), None)
    eagle_runs = [r for r in runs if r["mechanism"] in ("eagle", "eagle_tree")]
    if draft is None or not eagle_runs:
        return None
    configurations = {}
    for run in eagle_runs:
        key = f"{run['mechanism']}:{run['k']}"
        configurations[key] = {
            "mean_accepted_len": [run["mean_accepted_len"], draft["mean_accepted_len"]],
            "tok_s": [run["tok_s"], draft["tok_s"]],
            "beats_on_mean_accepted_len": run["mean_accepted_len"] > draft["mean_accepted_len"],
            "beats_on_tok_s": run["tok_s"] > draft["tok_s"],
            "categories_won_mean_accepted_len": sorted(
                c for c, cat in categories.items() if _beats(cat, key, draft_key, "mean_accepted_len")
            ),
            "categories_won_tok_s": sorted(c for c, cat in categories.items() if _beats(cat, key, draft_key, "tok_s")),
        }
    best = max(
        configurations,
        key=lambda key: (configurations[key]["beats_on_mean_accepted_len"] and configurations[key]["beats_on_tok_s"],
                         configurations[key]["tok_s"][0]),
    )  # fmt: skip
    return {"best": best, "draft": draft_key, "categories": len(categories), **configurations[best],
            "configurations": configurations}  # fmt: skip


def _beats(category: dict, ours: str, theirs: str, key: str) -> bool:
    return category["mechanisms"][ours][key] > category["mechanisms"][theirs][key]


def print_comparison(report: dict) -> None:
    comparison = report.get("eagle_vs_draft")
    if not comparison:
        return
    ours, theirs = comparison["best"], comparison["draft"]
    print(
        f"best EAGLE {ours} vs {theirs}: E[N] {comparison['mean_accepted_len'][0]:.2f} vs "
        f"{comparison['mean_accepted_len'][1]:.2f}, tok/s {comparison['tok_s'][0]:.1f} vs {comparison['tok_s'][1]:.1f}"
        f"; categories won on E[N] {len(comparison['categories_won_mean_accepted_len'])}/{comparison['categories']}, "
        f"on tok/s {len(comparison['categories_won_tok_s'])}/{comparison['categories']}"
    )
    for name, cat in report["categories"].items():
        mine, draft = cat["mechanisms"][ours], cat["mechanisms"][theirs]
        print(
            f"  {name:<15} E[N] {mine['mean_accepted_len']:.2f} vs {draft['mean_accepted_len']:.2f}  "
            f"tok/s {mine['tok_s']:.1f} vs {draft['tok_s']:.1f}"
        )
