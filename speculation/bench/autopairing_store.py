"""bench_autopairing's raw figures: one Measured per request, written to and read back from JSON, so the selection
can be simulated again without measuring, and shards measured by separate processes merge into one stream."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from speculation.engine.projection import StepCosts
from speculation.models import LOOKUP_KINDS, CandidateStatus, DraftKind
from speculation.worker.candidates import K_RANGE


@dataclass(frozen=True)
class Measured:
    workload: str
    multiplier: dict[tuple[str, int], float]  # (candidate, K) -> projected multiplier on this request
    tokens_per_step: dict[tuple[str, int], float]
    kinds: dict[str, str] = field(default_factory=dict)  # candidate -> kind (default: a lookup's / draft_model by name)
    k_mean: dict[tuple[str, int], float] = field(default_factory=dict)  # drafts per verification (costs again)
    index: int = 0  # the prompt's place in the mixed stream (shards merge in this order)
    per_pass: dict[tuple[str, int], float] = field(default_factory=dict)  # tokens per target pass (what S divides)
    model_steps: dict[tuple[str, int], float] = field(default_factory=dict)  # draft-model steps per pass (a hybrid)

    def rows(self, request_id: str = "") -> list[dict[str, Any]]:
        """This request's rows in the auto-pairing table's shape (one per candidate, K = 1..8; one request id:
        the selector pairs the candidates' figures on the same request, as it does shadow's)."""
        names = dict.fromkeys(name for name, _ in self.multiplier)
        return [
            {
                "workload": self.workload,
                "candidate": name,
                "kind": self.kinds.get(name, name if name in LOOKUP_KINDS else DraftKind.DRAFT_MODEL),
                "draft_id": None,
                "status": CandidateStatus.MEASURED,
                "multiplier": [self.multiplier.get((name, k)) for k in K_RANGE],
                "mean_accepted_len": [self.tokens_per_step.get((name, k)) for k in K_RANGE],
                "counts": [],
                "request_id": request_id,
            }
            for name in names
        ]


def dump_measurements(path: Path, measured: list[Measured], costs: dict[str, StepCosts]) -> None:
    """The raw per-request figures and the costs they were projected with."""
    data = {
        "costs": {name: {"target_step_s": c.target_step_s, "draft_step_s": c.draft_step_s,
                         "verify_s": {str(n): s for n, s in c.verify_s.items()}} for name, c in costs.items()},
        "requests": [
            {
                "index": m.index,
                "workload": m.workload,
                "kinds": m.kinds,
                "multiplier": {_text(key): v for key, v in m.multiplier.items()},
                "tokens_per_step": {_text(key): v for key, v in m.tokens_per_step.items()},
                "k_mean": {_text(key): v for key, v in m.k_mean.items()},
                "per_pass": {_text(key): v for key, v in m.per_pass.items()},
                "model_steps": {_text(key): v for key, v in m.model_steps.items()},
            }
            for m in measured
        ],
    }  # fmt: skip
    path.write_text(json.dumps(data) + "\n")


def load_measurements(paths: list[Path]) -> tuple[list[Measured], dict[str, StepCosts]]:
    """dump_measurements' files merged in the stream's order (ValueError naming the problem when one is not such
    a file). With several files (shards, each timed its costs), every request is projected again with the first
    file's costs, so one cost model prices every request."""
    merged: list[Measured] = []
    costs: dict[str, StepCosts] = {}
    for path in paths:
        measured, found = _read(path)
        costs = costs or found
        merged += measured
    if not merged:
        raise ValueError(f"{', '.join(map(str, paths))}: no requests")
    merged.sort(key=lambda m: m.index)
    if len(paths) > 1:
        merged = [_priced(m, costs) for m in merged]
    return merged, costs


def _read(path: Path) -> tuple[list[Measured], dict[str, StepCosts]]:
    try:
        data = json.loads(path.read_text())
        costs = {
            name: StepCosts(target_step_s=c["target_step_s"], draft_step_s=c["draft_step_s"],
                            verify_s={int(n): s for n, s in c["verify_s"].items()})
            for name, c in data["costs"].items()
        }  # fmt: skip
        measured = [
            Measured(
                workload=r["workload"],
                multiplier={_key(key): float(v) for key, v in r["multiplier"].items()},
                tokens_per_step={_key(key): float(v) for key, v in r["tokens_per_step"].items()},
                kinds=r["kinds"],
                k_mean={_key(key): float(v) for key, v in r.get("k_mean", {}).items()},
                index=int(r.get("index", i)),
                per_pass={_key(key): float(v) for key, v in r.get("per_pass", {}).items()},
                model_steps={_key(key): float(v) for key, v in r.get("model_steps", {}).items()},
            )
            for i, r in enumerate(data["requests"])
        ]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: not a bench_autopairing measurements file ({exc})") from exc
    return measured, costs


def _priced(m: Measured, costs: dict[str, StepCosts]) -> Measured:
    if not m.k_mean:
        raise ValueError("shards to merge need k_mean per request (measured before it was stored)")
    multiplier = {  # per target pass where the file has it (older files: per drafting step)
        key: costs[key[0]].multiplier(
            tokens_per_step=m.per_pass.get(key, m.tokens_per_step[key]),
            k=m.k_mean[key],
            draft_steps=m.model_steps.get(key),
        )
        for key in m.multiplier
    }
    return replace(m, multiplier=multiplier)


def _text(key: tuple[str, int]) -> str:
    return f"{key[0]}@K{key[1]}"


def _key(text: str) -> tuple[str, int]:
    name, _, k = text.rpartition("@K")
    return name, int(k)
