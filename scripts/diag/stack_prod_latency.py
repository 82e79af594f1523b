"""Prod on the local path through the bench stack, the goodput guard off: where a one-stream request's time goes,
and 8 / 32 streams with every request on the worker's batch.

    python scripts/diag/stack_prod_latency.py [--streams 1,8,32] [--rounds 3]    # ACE_WORKER_TORCH_THREADS=N to compare

Starts speculation.bench.stack.BenchStack (Redis, vLLM, one Celery worker, ACE) on the demo pair with
ACE_GOODPUT_GUARD=false, so every prod request speculates (demo-draft, K = 5, 64 new tokens).
- 1 stream: 4 streamed requests one after another per round, off then prod: time to the first token and the total.
- 8 / 32 streams: 2 requests per stream, off and prod alternating (1.5 s between, so vLLM's engine, which
  busy-waits about 1 s after its last request on this CPU build, is idle when prod starts): aggregate tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")

import django  # noqa: E402

django.setup()

import httpx  # noqa: E402

from speculation.bench.load import load_prompts, run_concurrent  # noqa: E402
from speculation.bench.stack import BenchStack  # noqa: E402
from speculation.offline.demo import ensure_demo_pair  # noqa: E402
from speculation.offline.eagle.prompts import spec_bench_path  # noqa: E402


async def _streamed(client: httpx.AsyncClient, url: str, prompt: str, headers: dict) -> tuple[float, float]:
    body = {"model": "demo", "prompt": prompt, "max_tokens": 64, "temperature": 0, "stream": True, "ignore_eos": True}
    started, first = time.perf_counter(), None
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as response:
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - started
    return (first or 0.0) * 1000, (time.perf_counter() - started) * 1000


async def _one_stream(stack: BenchStack, prompts: list[str]) -> list[tuple[float, float]]:
    async with httpx.AsyncClient(timeout=120) as client:
        return [await _streamed(client, stack.ace_url, p, stack.headers) for p in prompts]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    pair = ensure_demo_pair()
    prompts = [p for _, p in load_prompts(spec_bench_path(), per_category=1)]
    stack = BenchStack(
        target_dir=pair.target_dir, draft_dir=pair.draft_dir, extra_env={"ACE_GOODPUT_GUARD": "false"}
    ).start()
    try:
        stack.set_demo_pairing()
        asyncio.run(_one_stream(stack, prompts[:4]))  # the worker loads the pair
        for n in streams:
            for r in range(args.rounds):
                for mode in ("off", "prod"):
                    stack.set_policy("demo", mode=mode)
                    time.sleep(1.5)
                    if n == 1:
                        got = asyncio.run(_one_stream(stack, prompts[:4]))
                        ttft = statistics.median(t for t, _ in got)
                        total = statistics.median(t for _, t in got)
                        print(
                            f"1 stream {mode} round {r + 1}: first token {ttft:.0f} ms, total {total:.0f} ms (medians)"
                        )
                        continue
                    batch = [prompts[i % len(prompts)] for i in range(2 * n)]
                    wall, res = asyncio.run(
                        run_concurrent(
                            stack.ace_url,
                            model="demo",
                            prompts=batch,
                            max_tokens=64,
                            concurrency=n,
                            headers=stack.headers,
                        )
                    )
                    print(
                        f"{n} streams {mode} round {r + 1}: {sum(x.tokens for x in res) / wall:.1f} tok/s", flush=True
                    )
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
