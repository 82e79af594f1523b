"""Prod sent plain against off at the same moments: one vLLM behind two ACE endpoints, `demo` in prod (the bench's
pairing: demo draft, K = 5, local path) and `demo-off` in off, and each round sends every prompt to both at once,
interleaved, at 8 or 32 streams in all. The goodput guard sends `demo`'s prod requests plain at these loads (the
worker shares the server's machine), so the two differ only by what the gateway does for a plain prod request, and
a drift of the machine, which made bench_gateway's prod / off rounds at 8 streams differ by 7-12 % (sd), falls on
both halves of a round alike.

    python scripts/diag/mixed_plain.py [--rounds 6] [--json PATH]

Per load and traffic kind, prod / off per round: of the mean per-request tok/s (tokens / the request's seconds), and
of tokens / seconds summed over each endpoint's requests (each request weighted by its seconds: the endpoint's
throughput per stream); their means over rounds with 90 % Student-t intervals; the median over prompts of the paired
per-request ratio; and what prod recorded (skipped by the guard / speculated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")

import django  # noqa: E402

django.setup()

from speculation.bench.concurrency import SAMPLINGS, _mean_interval  # noqa: E402
from speculation.bench.load import chat, load_prompts  # noqa: E402
from speculation.bench.stack import BenchStack  # noqa: E402
from speculation.offline.demo import ensure_demo_pair  # noqa: E402
from speculation.offline.eagle.prompts import spec_bench_path  # noqa: E402

LOADS = {8: 16, 32: 64}  # streams in all -> requests per round (half to each endpoint)


def register_off_twin(stack: BenchStack) -> None:
    headers = {"Authorization": f"Token {stack.token}"}
    body = {"name": "demo-off", "base_url": stack.vllm_url, "kind": "vllm", "node_class": "cpu"}
    created = httpx.post(f"{stack.ace_url}/api/v1/endpoints/", json=body, headers=headers, timeout=30)
    if created.status_code != 201:
        raise RuntimeError(f"demo-off refused: {created.text}")
    pk = created.json()["id"]
    deadline = time.monotonic() + 120
    while httpx.get(f"{stack.ace_url}/api/v1/endpoints/{pk}/", headers=headers).json().get("status") != "ready":
        if time.monotonic() > deadline:
            raise RuntimeError("demo-off was not probed ready within 120 s")
        time.sleep(1.0)
    stack.endpoints["demo-off"] = {"id": pk}


async def mixed_round(stack: BenchStack, prompts: list[str], *, streams: int, sampling: dict) -> dict[str, list]:
    """Each prompt to both endpoints, the two requests next to each other in the queue (each endpoint first for every
    other prompt); `streams` in flight in all.
    Per endpoint, each request's (tokens, seconds) in prompt order."""
    # each endpoint first for every other prompt: the twin sent second may find the prompt in vLLM's prefix cache
    order = [
        (model, prompt)
        for i, prompt in enumerate(prompts)
        for model in (("demo", "demo-off") if i % 2 == 0 else ("demo-off", "demo"))
    ]
    sem = asyncio.Semaphore(streams)
    rates: dict[str, list] = {"demo": [None] * len(prompts), "demo-off": [None] * len(prompts)}
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:  # one client, as the bench's load has

        async def one(index: int, model: str, prompt: str) -> None:
            async with sem:
                result = await chat(
                    client, stack.ace_url, model=model, prompt=prompt, max_tokens=64, headers=stack.headers,
                    stream=True, sampling=sampling,
                )  # fmt: skip
                rates[model][index] = (result.tokens, result.latency_s)

        await asyncio.gather(*(one(i // 2, model, prompt) for i, (model, prompt) in enumerate(order)))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    pair = ensure_demo_pair()
    prompts = [p for _, p in load_prompts(Path(spec_bench_path()), per_category=3)]
    stack = BenchStack(target_dir=pair.target_dir, draft_dir=pair.draft_dir, with_native=False).start()
    out: dict = {}
    try:
        stack.set_demo_pairing()
        register_off_twin(stack)
        asyncio.run(mixed_round(stack, prompts[:4], streams=8, sampling={}))  # warm: models, connections
        before = {r["id"] for r in stack.records("demo", mode="prod")}
        for kind, sampling in SAMPLINGS.items():
            for streams, requests in LOADS.items():
                per_round, goodput, pairs = [], [], []
                for index in range(args.rounds):
                    batch = [prompts[(index * requests // 2 + i) % len(prompts)] for i in range(requests // 2)]
                    rates = asyncio.run(mixed_round(stack, batch, streams=streams, sampling=sampling))
                    prod, off = rates["demo"], rates["demo-off"]

                    def mean_rate(runs: list) -> float:
                        return statistics.mean(t / s for t, s in runs if s > 0)

                    def tokens_per_second(runs: list) -> float:
                        return sum(t for t, _ in runs) / sum(s for _, s in runs)

                    per_round.append(round(mean_rate(prod) / mean_rate(off), 4))
                    goodput.append(round(tokens_per_second(prod) / tokens_per_second(off), 4))
                    pairs += [(tp / sp) / (to / so) for (tp, sp), (to, so) in zip(prod, off, strict=True) if to and sp]
                    print(kind, streams, index, per_round[-1], goodput[-1], flush=True)
                interval = _mean_interval(goodput)
                out.setdefault(kind, {})[str(streams)] = {
                    "mean_tok_s_ratio_per_round": per_round,
                    **{k.replace("prod_over_off", "mean_tok_s_ratio"): v for k, v in _mean_interval(per_round).items()},
                    "tokens_over_seconds_ratio_per_round": goodput,
                    **{k.replace("prod_over_off", "tokens_over_seconds_ratio"): v for k, v in interval.items()},
                    "paired_median": round(statistics.median(pairs), 4),
                    "pairs": len(pairs),
                }
        time.sleep(2.0)
        records = [r for r in stack.records("demo", mode="prod") if r["id"] not in before]
        out["prod_records"] = {
            action: sum(1 for r in records if r["action"] == action) for action in {r["action"] for r in records}
        }
        out["meta"] = {"rounds": args.rounds, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    finally:
        stack.stop()
    text = json.dumps(out, indent=2)
    print(text)
    if args.json_path:
        Path(args.json_path).write_text(text + "\n")


if __name__ == "__main__":
    main()
