"""The captured-traffic loop measured (manage.py bench_traffic_loop): a workload mix unlike the shipped head's
training data, captured through the gateway, a head trained on the captures, both heads compared on the requests
the run held out.

The workloads are synthetic, built from the demo corpus' held-out files (never from its training split, which the
shipped head's prompts come from): `code` starts mid-file in source code, `lists` asks for a numbered list of a
module's names. `measure` runs inside the bench stack's database (a `manage.py shell` of its environment): it trains
through the product's own training run on `captured:<endpoint>` (continuing from the shipped head, a warm start, or
from scratch; run_training registers the head and replays the held-out captures on the endpoint's candidates), then
replays both heads greedily on the run's held-out captures (speculation.offline.eagle.evaluate, the exact replay
training reports). `shape` and `table` are pure.
"""

from __future__ import annotations

import ast
import random
import time
from pathlib import Path
from typing import Any

WORKLOADS = ("code", "lists")
CODE_PROMPT_CHARS = 320
LIST_ITEMS = 4


def workload_prompts(workloads: tuple[str, ...], *, per_workload: int, seed: int = 0) -> dict[str, list[str]]:
    """per_workload prompts of each workload, from the demo corpus' held-out files (seeded order)."""
    from speculation.offline.demo.corpus import stdlib_corpus

    files = list(stdlib_corpus().held_out_files)
    random.Random(seed).shuffle(files)
    out: dict[str, list[str]] = {w: [] for w in workloads}
    for path in files:
        if all(len(v) >= per_workload for v in out.values()):
            break
        source = path.read_text(encoding="utf-8", errors="replace")
        if "code" in out and len(out["code"]) < per_workload and len(source) > 4 * CODE_PROMPT_CHARS:
            start = source.find("\n", len(source) // 3) + 1  # mid-file, at a line start
            out["code"].append(source[start : start + CODE_PROMPT_CHARS].rstrip())
        if "lists" in out and len(out["lists"]) < per_workload:
            names = _names(source)
            if len(names) > LIST_ITEMS:
                items = "\n".join(f"{i}. {name}" for i, name in enumerate(names[:LIST_ITEMS], 1))
                out["lists"].append(f"The functions and classes of {path.stem}:\n{items}\n{LIST_ITEMS + 1}.")
    short = {w: len(v) for w, v in out.items() if len(v) < per_workload}
    if short:
        raise ValueError(f"the demo corpus' held-out files give too few prompts: {short} of {per_workload}")
    return out


def _names(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]


def training_options(*, new_tokens: int, multi_layer: bool) -> dict[str, Any]:
    """The run's options: the multi-layer recipe (EAGLE-3's token-led loss and two drafting steps trained,
    speculation.offline.eagle.demo_head.EAGLE3, the shipped head's own) on the captures, or the single-layer head's
    defaults. A warm start trains in the head's own format (the shipped head: format 2) at the warm-start rate."""
    from speculation.offline.eagle.settings import MULTI_LAYER_WEIGHTS

    options: dict[str, Any] = {"new_tokens": new_tokens, "held_out": 0.25, "max_prompt_tokens": 256}
    if multi_layer:
        options.update(multi_layer=True, unroll=2, **MULTI_LAYER_WEIGHTS)
    return options


def measure(
    *,
    endpoint_id: int,
    target_dir: str,
    shipped_dir: str,
    out_dir: str,
    epochs: int,
    options: dict,
    k: int,
    init_from: str = "",
) -> dict[str, Any]:
    """Train on the endpoint's captures (a training run, as the page starts one; continuing from the head init_from
    names, "": from scratch), then both heads' greedy replay on the captures the run held out, per workload. Needs
    Django with the stack's database."""
    import torch

    from speculation.engine.eagle import EagleHead
    from speculation.offline.eagle.captured import collect_captured
    from speculation.offline.eagle.collect import load_target, target_weights
    from speculation.offline.eagle.evaluate import replay
    from speculation.offline.eagle.prompts import split_prompts
    from speculation.offline.eagle.settings import PipelineSettings
    from speculation.services.eagle_training import captured_sequences, create_training_run, run_training

    run = create_training_run(target_dir=target_dir, out_dir=out_dir, prompts=f"captured:{endpoint_id}", epochs=epochs,
                              options=dict(options), name="traffic-loop", init_from=init_from)  # fmt: skip
    started = time.perf_counter()
    run = run_training(run=run)
    train_s = time.perf_counter() - started
    settings = PipelineSettings.from_dict(run.config)
    train_part, held_out = split_prompts(captured_sequences(settings), held_out=settings.held_out)
    model, _ = load_target(Path(target_dir))
    embed, lm_head = target_weights(model)
    heads = {"shipped": shipped_dir, "trained": run.out_dir}
    stats: dict[str, dict[str, dict]] = {}
    with torch.no_grad():
        for name, directory in heads.items():
            head = EagleHead.load(Path(directory), target_dir=Path(target_dir))
            sizes = {"max_prompt_tokens": settings.max_prompt_tokens, "new_tokens": settings.new_tokens}
            data = collect_captured(model, held_out, feature_layers=head.config.feature_layers, **sizes)
            pooled, by_workload = replay(head, embed, lm_head, data, k=k)
            stats[name] = {"all": pooled.as_dict(), **{w: s.as_dict() for w, s in by_workload.items()}}
    return {
        "run": {
            "id": run.pk,
            "status": run.status,
            "draft": run.draft.name if run.draft else None,
            "train_s": round(train_s, 1),
            "train_requests": len(train_part),
            "held_out_requests": len(held_out),
            "multi_layer": settings.multi_layer,
            "init_from": init_from or None,
            "lr": settings.train.lr,
            "head_format": _head_format(run.out_dir),
            "epochs": epochs,
            "kept_epoch": (run.log or [{}])[-1].get("best_epoch"),
            "run_mean_accepted_len": run.mean_accepted_len,
        },
        "held_out_per_workload": {
            w: sum(1 for s in held_out if s.category == w) for w in {s.category for s in held_out}
        },
        "stats": stats,
    }


def _head_format(directory: str) -> int | None:
    from speculation.engine.eagle_format import head_format, read_config

    config = read_config(directory)
    return head_format(config) if config else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def shape(measured: dict[str, Any], *, prod: dict[str, Any] | None, prod_reason: str = "") -> dict[str, Any]:
    """The bench's JSON from `measure`'s result and the shadow/prod comparison (None: not measured, why)."""
    stats = measured["stats"]
    shipped, trained = stats["shipped"]["all"], stats["trained"]["all"]
    workloads = {
        w: {
            "held_out_requests": measured["held_out_per_workload"].get(w, 0),
            "shipped_mean_accepted_len": stats["shipped"][w]["mean_accepted_len"],
            "trained_mean_accepted_len": stats["trained"][w]["mean_accepted_len"],
            "gain": _ratio(stats["trained"][w]["mean_accepted_len"], stats["shipped"][w]["mean_accepted_len"]),
            "shipped_alpha": stats["shipped"][w]["alpha"],
            "trained_alpha": stats["trained"][w]["alpha"],
        }
        for w in sorted(k for k in stats["shipped"] if k != "all")
    }
    out = {
        "shipped_mean_accepted_len": shipped["mean_accepted_len"],
        "trained_mean_accepted_len": trained["mean_accepted_len"],
        "gain": _ratio(trained["mean_accepted_len"], shipped["mean_accepted_len"]),
        "k": shipped["k"],
        "workloads": workloads,
        "run": measured["run"],
        "prod_over_shadow": None,
    }
    if prod and prod.get("median_ratio"):
        out["prod_over_shadow"] = round(1 / prod["median_ratio"], 4)
        out["shadow_vs_prod"] = prod
    else:
        out["prod_over_shadow_reason"] = prod_reason or "not measured"
        if prod:
            out["shadow_vs_prod"] = prod
    return out


def table(result: dict[str, Any]) -> str:
    """A short text table: mean accepted length per workload, shipped vs trained."""
    lines = [f"{'workload':<10} {'held out':>8} {'shipped':>8} {'trained':>8} {'gain':>6}"]
    rows = [(w, r["held_out_requests"], r["shipped_mean_accepted_len"], r["trained_mean_accepted_len"], r["gain"])
            for w, r in result["workloads"].items()]  # fmt: skip
    rows.append(("all", sum(r[1] for r in rows), result["shipped_mean_accepted_len"],
                 result["trained_mean_accepted_len"], result["gain"]))  # fmt: skip
    for name, n, shipped, trained, gain in rows:
        lines.append(f"{name:<10} {n:>8} {shipped:>8.3f} {trained:>8.3f} {gain if gain is not None else '-':>6}")
    pos = result["prod_over_shadow"]
    lines.append(f"prod_over_shadow: {pos if pos is not None else 'null (' + result['prod_over_shadow_reason'] + ')'}")
    return "\n".join(lines)
