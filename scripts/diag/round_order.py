"""What going second in a pair of rounds is worth: the bench stack (Redis, vLLM, one worker, ACE), the demo endpoint,
8 streams, pairs of rounds of 16 greedy requests of 64 tokens, each pair on a new batch of prompts and both rounds of
a pair on the same batch, in the modes given (`off,off` for an A/A control: the two rounds differ only by their
order). Prints each pair's tok/s and the ratio second / first, then their median, mean and standard deviation.

    python scripts/diag/round_order.py [--modes off,off] [--pairs 12] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")

import django  # noqa: E402

django.setup()

from speculation.bench.load import load_prompts, run_concurrent  # noqa: E402
from speculation.bench.stack import BenchStack  # noqa: E402
from speculation.offline.demo import ensure_demo_pair  # noqa: E402
from speculation.offline.eagle.prompts import spec_bench_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="off,off")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if len(modes) != 2 or any(m not in ("off", "shadow", "prod") for m in modes):
        parser.error("--modes takes two of off, shadow, prod, e.g. off,off")
    pair = ensure_demo_pair()
    prompts = [p for _, p in load_prompts(Path(spec_bench_path()), per_category=2)]
    stack = BenchStack(target_dir=pair.target_dir, draft_dir=pair.draft_dir, with_native=False).start()
    rows = []
    try:
        stack.set_demo_pairing()
        warm = dict(max_tokens=16, concurrency=1, headers=stack.headers, sampling={})
        asyncio.run(run_concurrent(stack.ace_url, model="demo", prompts=prompts[:1], **warm))
        for index in range(args.pairs):
            batch = [prompts[(index * 16 + j) % len(prompts)] for j in range(16)]
            row = []
            for mode in modes:
                stack.set_policy("demo", mode=mode)
                wall, results = asyncio.run(
                    run_concurrent(
                        stack.ace_url, model="demo", prompts=batch, max_tokens=64, concurrency=8,
                        headers=stack.headers, sampling={"temperature": 0.0},
                    )
                )  # fmt: skip
                row.append(sum(r.tokens for r in results) / wall)
            rows.append(row)
            print(index, [round(x, 1) for x in row], round(row[1] / row[0], 3), flush=True)
    finally:
        stack.stop()
    ratios = [second / first for first, second in rows]
    out = {
        "modes": modes,
        "tok_s_pairs": [[round(x, 1) for x in row] for row in rows],
        "second_over_first": [round(r, 4) for r in ratios],
        "median": round(statistics.median(ratios), 4),
        "mean": round(statistics.mean(ratios), 4),
        "sd": round(statistics.stdev(ratios), 4) if len(ratios) > 1 else None,
    }
    print(json.dumps(out))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
