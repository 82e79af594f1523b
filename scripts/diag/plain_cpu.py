"""The web process's CPU for a prod request the goodput guard sends plain, against an off request: 8 streams of the
demo endpoint through ACE (the bench stack: Redis, vLLM, one worker, ACE), off and prod rounds alternating (prod at
8 streams on this shared 2-core machine goes plain by the guard's rule), each round 16 greedy requests of 64 tokens;
per round tok/s and the CPU seconds of ACE's, vLLM's and the worker's process trees (from /proc).

    python scripts/diag/plain_cpu.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")

import django  # noqa: E402

django.setup()

from speculation.bench.gateway_overhead import cpu_s  # noqa: E402
from speculation.bench.load import load_prompts, run_concurrent  # noqa: E402
from speculation.bench.stack import BenchStack  # noqa: E402
from speculation.offline.demo import ensure_demo_pair  # noqa: E402
from speculation.offline.eagle.prompts import spec_bench_path  # noqa: E402


def tree(pid: int) -> list[int]:
    """pid and its descendants."""
    out = [pid]
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == pid:
            out += tree(int(p))
    return out


def cpu(pids: list[int]) -> float:
    """User + system CPU seconds of the processes (those still running)."""
    total = 0.0
    for pid in pids:
        try:
            total += cpu_s(pid)
        except OSError:
            pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    pair = ensure_demo_pair()
    prompts = [p for _, p in load_prompts(Path(spec_bench_path()), per_category=2)]
    stack = BenchStack(target_dir=pair.target_dir, draft_dir=pair.draft_dir, with_native=False).start()
    try:
        stack.set_demo_pairing()
        warm = dict(max_tokens=16, concurrency=1, headers=stack.headers, sampling={})
        asyncio.run(run_concurrent(stack.ace_url, model="demo", prompts=prompts[:1], **warm))
        groups = {name: tree(stack.procs[name].pid) for name in ("ace", "vllm", "worker")}
        rows: dict[str, list[dict]] = {"off": [], "prod": []}
        for index in range(rounds):
            for mode in ("off", "prod"):
                stack.set_policy("demo", mode=mode)
                time.sleep(1.0)
                batch = [prompts[(index * 16 + i) % len(prompts)] for i in range(16)]
                before = {name: cpu(pids) for name, pids in groups.items()}
                wall, results = asyncio.run(
                    run_concurrent(
                        stack.ace_url, model="demo", prompts=batch, max_tokens=64, concurrency=8,
                        headers=stack.headers, sampling={"temperature": 0.0},
                    )
                )  # fmt: skip
                row = {"tok_s": round(sum(r.tokens for r in results) / wall, 1), "wall_s": round(wall, 2)}
                row.update({f"{name}_cpu_s": round(cpu(pids) - before[name], 3) for name, pids in groups.items()})
                rows[mode].append(row)
                print(mode, index, row, flush=True)
        for mode, done in rows.items():
            print(mode, "mean", {key: round(sum(r[key] for r in done) / len(done), 3) for key in done[0]})
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
