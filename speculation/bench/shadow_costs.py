"""The batch engine's row (BatchRowTarget / BatchRowDraft, speculation.worker.costs_batch: the forward prod's local
path runs while the worker batches) against the batch-1 engine (LocalTarget / DraftModelProposer) on the demo pair.
(Shadow's calibration of the batched path now times the batch decoder's own steps, BatchStepTimer, which include
the decoder's work around these forwards.)

    python -m speculation.bench.shadow_costs [--rounds 15] [--json out.json]

Both are timed in the same run, interleaved round by round (so a load change hits both alike), each round's
figure the fastest of speculation.engine.costs.REPEATS; the report is each engine's fastest round and the ratios
batch / single for verify(n) and the draft step. Greedy, a 64-token context from the first Spec-Bench prompt.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from speculation.engine import DraftModelProposer, LocalTarget, load_causal_lm
from speculation.engine.costs import time_draft_step, time_verify

logger = logging.getLogger(__name__)

SIZES = (1, 2, 4, 9)
CONTEXT = 64


def measure(target_dir: Path, draft_dir: Path, context: list[int], *, rounds: int) -> dict:
    from speculation.worker.costs_batch import BatchRowDraft, BatchRowTarget

    target, draft = load_causal_lm(str(target_dir)), load_causal_lm(str(draft_dir))
    engines = {
        "single": (LocalTarget(target), DraftModelProposer(draft, target_vocab_size=target.vocab_size)),
        "batch": (BatchRowTarget(target), BatchRowDraft(draft)),
    }
    best: dict[str, dict] = {name: {"verify_ms": {}, "draft_step_ms": None} for name in engines}
    for _ in range(rounds):
        for name, (verifier, proposer) in engines.items():
            verify = time_verify(verifier, context, SIZES)
            step = time_draft_step(proposer, context)
            found = best[name]
            for n, seconds in verify.items():
                found["verify_ms"][n] = min(found["verify_ms"].get(n, float("inf")), seconds * 1000)
            found["draft_step_ms"] = min(found["draft_step_ms"] or float("inf"), step * 1000)
    single, batch = best["single"], best["batch"]
    return {
        "rounds": rounds,
        "single": _rounded(single),
        "batch": _rounded(batch),
        "batch_over_single": {
            **{f"verify_{n}": round(batch["verify_ms"][n] / single["verify_ms"][n], 3) for n in SIZES},
            "draft_step": round(batch["draft_step_ms"] / single["draft_step_ms"], 3),
        },
        "load_average": list(os.getloadavg()),
    }


def _rounded(found: dict) -> dict:
    return {
        "verify_ms": {n: round(v, 3) for n, v in found["verify_ms"].items()},
        "draft_step_ms": round(found["draft_step_ms"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")
    import django

    django.setup()
    from transformers import AutoTokenizer

    from speculation.offline.demo import ensure_demo_pair
    from speculation.offline.eagle.prompts import read_prompts, spec_bench_path

    pair = ensure_demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(str(pair.target_dir))
    text = " ".join(p.text for p in read_prompts(str(spec_bench_path()))[:4])
    context = tokenizer(text)["input_ids"][:CONTEXT]
    result = measure(pair.target_dir, pair.draft_dir, context, rounds=args.rounds)
    text_out = json.dumps(result, indent=2)
    print(text_out)
    if args.json_path:
        Path(args.json_path).write_text(text_out + "\n")


if __name__ == "__main__":
    main()
