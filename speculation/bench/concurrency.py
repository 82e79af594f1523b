"""bench_gateway's `concurrency` and `shadow_vs_prod` sections: prod against off under concurrent greedy and sampled
traffic, and shadow's projected multiplier against the one prod then measures on the same prompts.

For 1, 8 and 32 concurrent streams, greedy and sampled (temperature 0.7, top_p 0.9): the same requests through
ACE in off mode, in prod on the local path at the policy's K, and in prod on the same path at K = 0 (the engine's
plain decoding, a worker started with ACE_PROD_PLAIN=true), so that `prod_over_plain_same_path` is the gain of
speculation alone and `prod_over_off` the user's gain over the server. `shape` turns the measured runs into the
issue's JSON; it is pure, so a test pins the shape.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from speculation.bench.load import quantile, run_concurrent
from speculation.bench.stack import BenchStack

CONCURRENCY = (1, 8, 32)
SAMPLINGS = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}
OUTCOMES = ("speculated", "skipped", "fell_back")


@dataclass
class Run:
    """One set of requests at one concurrency: aggregate rate, per-request latencies, what prod recorded."""

    tok_s: float
    latencies_s: list[float]
    outcomes: Counter = field(default_factory=Counter)
    token_ids: list[list[int]] = field(default_factory=list)


def run_once(
    stack: BenchStack,
    prompts: list[str],
    *,
    concurrency: int,
    max_tokens: int,
    sampling: dict,
    prod: bool,
    endpoint: str = "demo",
) -> Run:
    seen = {r["id"] for r in stack.records(endpoint, mode="prod")} if prod else set()
    wall, results = asyncio.run(
        run_concurrent(
            stack.ace_url,
            model=endpoint,
            prompts=prompts,
            max_tokens=max_tokens,
            concurrency=concurrency,
            headers=stack.headers,
            sampling=sampling,
        )
    )
    run = Run(
        tok_s=sum(r.tokens for r in results) / wall if wall > 0 else 0.0,
        latencies_s=[r.latency_s for r in results],
        token_ids=[r.token_ids for r in results],
    )
    if prod:
        records = wait_records(stack, endpoint, "prod", len(seen) + len(prompts))
        run.outcomes = Counter(r["action"] for r in records if r["id"] not in seen)
    return run


def run_all(
    stack: BenchStack, prompts: list[str], *, requests: dict[int, int], max_tokens: int, log: Callable[[str], None]
) -> dict[str, dict[str, dict[str, Run]]]:
    """{"off" | "prod" | "plain": {"greedy" | "sampled": {"1" | "8" | "32": Run}}}, one phase per worker setup.

    The last phase restarts the worker with ACE_PROD_PLAIN=true and leaves it so (call it last in a run)."""

    def phase(name: str, prod: bool) -> dict[str, dict[str, Run]]:
        run_once(stack, prompts[:1], concurrency=1, max_tokens=max_tokens, sampling={}, prod=prod)  # warm: load
        out: dict[str, dict[str, Run]] = {}
        for kind, sampling in SAMPLINGS.items():
            for concurrency in CONCURRENCY:
                batch = [prompts[i % len(prompts)] for i in range(requests[concurrency])]
                run = run_once(
                    stack, batch, concurrency=concurrency, max_tokens=max_tokens, sampling=sampling, prod=prod
                )
                out.setdefault(kind, {})[str(concurrency)] = run
                log(f"concurrency {name} {kind} x{concurrency}: {run.tok_s:.1f} tok/s {dict(run.outcomes)}")
        return out

    stack.set_policy("demo", mode="off")
    measured = {"off": phase("off", prod=False)}
    stack.set_policy("demo", mode="prod", path="local", target_path=str(stack.target_dir))
    measured["prod"] = phase("prod", prod=True)
    stack.restart_worker(extra_env={"ACE_PROD_PLAIN": "true"})  # the same path at K = 0: the engine's plain decoding
    measured["plain"] = phase("plain", prod=True)
    return measured


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def shape(measured: dict[str, dict[str, dict[str, Run]]]) -> dict:
    """The issue's `concurrency` JSON: per traffic kind and concurrency, prod / off and prod / plain same path."""
    out: dict = {}
    for kind, rows in measured["prod"].items():
        for concurrency, prod in rows.items():
            off = measured["off"][kind][concurrency]
            plain = measured["plain"][kind][concurrency]
            out.setdefault(kind, {})[concurrency] = {
                "prod_over_off": _ratio(prod.tok_s, off.tok_s),
                "p50_ms": round(quantile(prod.latencies_s, 0.5) * 1000, 1),
                "p99_ms": round(quantile(prod.latencies_s, 0.99) * 1000, 1),
                **{outcome: prod.outcomes.get(outcome, 0) for outcome in OUTCOMES},
                "prod_over_plain_same_path": _ratio(prod.tok_s, plain.tok_s),
                "plain_fell_back": plain.outcomes.get("fell_back", 0),  # > 0: the K = 0 rate is partly the server's
                "tok_s": {"off": round(off.tok_s, 2), "prod": round(prod.tok_s, 2), "plain": round(plain.tok_s, 2)},
                "off_p50_ms": round(quantile(off.latencies_s, 0.5) * 1000, 1),
                "requests": len(prod.latencies_s),
            }
            if kind == "greedy":
                same = sum(a == b for a, b in zip(prod.token_ids, off.token_ids, strict=True))
                out[kind][concurrency]["identical_to_off"] = f"{same} of {len(prod.token_ids)}"
    return out


def shadow_vs_prod(shadow: list[dict], prod: list[dict]) -> dict:
    """Median of shadow-projected / prod-measured multiplier over the requests both measured, paired in order."""
    pairs = [
        (s["multiplier"], p["multiplier"])
        for s, p in zip(sorted(shadow, key=lambda r: r["id"]), sorted(prod, key=lambda r: r["id"]), strict=False)
        if s.get("multiplier") and p.get("multiplier")
    ]
    ratios = [s / p for s, p in pairs]
    return {
        "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
        "requests": len(ratios),
        "shadow_median": round(statistics.median(s for s, _ in pairs), 4) if pairs else None,
        "prod_median": round(statistics.median(p for _, p in pairs), 4) if pairs else None,
    }


def wait_records(stack: BenchStack, endpoint: str, mode: str, count: int, timeout_s: float = 300) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        records = stack.records(endpoint, mode=mode)
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(0.5)
