"""bench_gateway's `concurrency` and `shadow_vs_prod` sections: prod against off under concurrent greedy and sampled
traffic, and shadow's projected multiplier against the one prod then measures on the same prompts.

For 1, 8 and 32 concurrent streams, greedy and sampled (temperature 0.7, top_p 0.9): the same requests through
ACE in off mode, in prod on the local path at the policy's K, and in prod on the same path at K = 0 (the engine's
plain decoding, a worker started with ACE_PROD_PLAIN=true), so that `prod_over_plain_same_path` is the gain of
speculation alone and `prod_over_off` the user's gain over the server. `shape` turns the measured runs into the
bench's JSON; it is pure, so a test pins the shape.

With the goodput guard on (the product's default), each load runs `rounds` rounds of off and of prod, alternating
(off, prod, off, prod: a drift of the machine falls on both alike). Off traffic is also the guard's warm-up (plain
serving by the same server: its tok/s per load and traffic kind are the guard's plain samples, as on an endpoint
that ran in off or shadow before prod); in prod the guard learns in the first rounds and acts in the later ones
(`prod_over_off_last_round`). The K = 0 phase
runs with the guard off (ACE restarted with ACE_GOODPUT_GUARD=false): it measures the engine, not the guard.
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
from speculation.limits import DEFAULT_K

CONCURRENCY = (1, 8, 32)


def settle() -> None:
    """Wait out the goodput guard's burst window after a higher load: it decides a request by the endpoint's peak
    load of the last RECENT_S seconds (the first request of a burst starts alone but runs among all), so the first
    requests of one stream right after 32 would be decided, and served plain, as 32. Each load is measured in its
    steady state."""
    from speculation.gateway.goodput import RECENT_S

    time.sleep(RECENT_S + 1.0)


SAMPLINGS = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}
OUTCOMES = ("speculated", "skipped", "fell_back")
PROD_K = DEFAULT_K  # the policy's K in prod (the demo's default)


GUARD = "goodput guard"  # in the reason of a request the guard decided (sent plain, or let speculate)


@dataclass
class Run:
    """One set of requests at one concurrency: aggregate rate, per-request latencies, what prod recorded; a merged
    run (`merge`) keeps its rounds."""

    tok_s: float
    latencies_s: list[float]
    outcomes: Counter = field(default_factory=Counter)
    token_ids: list[list[int]] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    guard_skipped: int = 0
    reasons: Counter = field(default_factory=Counter)  # "action: reason" (figures cut) -> requests
    rounds: list[Run] = field(default_factory=list)


def merge(runs: list[Run]) -> Run:
    """Rounds at one load as one run: tokens over wall time summed, latencies and outcomes pooled."""
    wall = sum(r.wall_s for r in runs)
    return Run(
        tok_s=sum(r.tokens for r in runs) / wall if wall > 0 else 0.0,
        latencies_s=[x for r in runs for x in r.latencies_s],
        outcomes=sum((r.outcomes for r in runs), Counter()),
        token_ids=[ids for r in runs for ids in r.token_ids],
        tokens=sum(r.tokens for r in runs),
        wall_s=wall,
        guard_skipped=sum(r.guard_skipped for r in runs),
        reasons=sum((r.reasons for r in runs), Counter()),
        rounds=runs,
    )


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
    tokens = sum(r.tokens for r in results)
    run = Run(
        tok_s=tokens / wall if wall > 0 else 0.0,
        latencies_s=[r.latency_s for r in results],
        token_ids=[r.token_ids for r in results],
        tokens=tokens,
        wall_s=wall,
    )
    if prod:
        records = wait_new_records(stack, endpoint, "prod", seen=seen, count=len(prompts))
        run.outcomes = Counter(r["action"] for r in records)
        run.guard_skipped = sum(1 for r in records if r["action"] == "skipped" and GUARD in (r.get("reason") or ""))
        run.reasons = Counter(reason_key(r) for r in records)
    return run


def run_all(
    stack: BenchStack,
    prompts: list[str],
    *,
    requests: dict[int, int],
    max_tokens: int,
    log: Callable[[str], None],
    rounds: int = 1,
    loads: tuple[int, ...] = CONCURRENCY,
    wait: Callable[[], None] = settle,
    mechanism: str = "draft_model",
    fresh: bool = False,
) -> dict[str, dict[str, dict[str, Run]]]:
    """{"off" | "prod" | "plain": {"greedy" | "sampled": {"1" | "8" | "32": Run}}} (the keys: `loads`). Off and prod
    alternate round by round at each load (off, prod, prod, off, off, prod...: `rounds` of each, merged runs that keep
    their rounds, each mode first in every other pair), so a drift of the machine's speed (another job starting, the
    server warming) and the advantage of going second fall on both alike; the K = 0 phase runs once per load after
    them.

    The last phase restarts the worker with ACE_PROD_PLAIN=true and ACE with the guard off, and leaves them so
    (call it last in a run). mechanism: prod's ("eagle_head": the demo head at dynamic K; the demo draft; a
    lookup: "ngram", "suffix", or "suffix_draft": suffix decoding with the demo draft's fallback). fresh: every round
    of a load sends prompts no earlier round sent (off's round r and prod's round r the same ones), so neither the
    server's and ACE's prefix caches nor suffix decoding's store of earlier answers meets a prompt twice; else each
    round sends the first prompts of the list again."""
    offset = {"n": 0}  # fresh: where the next load's prompts start

    def one(name: str, kind: str, concurrency: int, index: int) -> Run:
        start = offset["n"] + index * requests[concurrency] if fresh else 0
        batch = [prompts[(start + i) % len(prompts)] for i in range(requests[concurrency])]
        run = run_once(
            stack, batch, concurrency=concurrency, max_tokens=max_tokens, sampling=SAMPLINGS[kind], prod=name != "off"
        )
        log(
            f"concurrency {name} {kind} x{concurrency} round {index + 1}: {run.tok_s:.1f} tok/s "
            f"{dict(run.outcomes)} guard skipped {run.guard_skipped}"
        )
        return run

    def mode(name: str) -> None:
        stack.set_policy("demo", mode="off" if name == "off" else "prod")

    # in full: left at its defaults, `--only concurrency` measured n-gram until 12-01
    stack.set_demo_pairing(k=PROD_K, mechanism=mechanism)
    run_once(stack, prompts[:1], concurrency=1, max_tokens=max_tokens, sampling={}, prod=True)  # warm: load models
    measured: dict[str, dict[str, dict[str, Run]]] = {"off": {}, "prod": {}}
    last_load = 0
    for kind in SAMPLINGS:
        for concurrency in loads:
            if concurrency < last_load:
                wait()  # the guard's window of the higher load passes first (settle)
            last_load = concurrency
            runs: dict[str, list[Run]] = {"off": [], "prod": []}
            for index in range(rounds):
                # off first in the first round: the guard's plain samples at this load (its warm-up); then the order
                # alternates, so that what favours the second round of a pair (vLLM's prefix cache holding the
                # prompts, a machine that warms up) falls on each mode alike: in an A/A run of off against off at 8
                # streams the second round of a pair ran 1.07x the first (median of 12 pairs; docs/BENCHMARKS.md)
                for name in ("off", "prod") if index % 2 == 0 else ("prod", "off"):
                    mode(name)
                    runs[name].append(one(name, kind, concurrency, index))
            offset["n"] += rounds * requests[concurrency]
            for name, done in runs.items():
                measured[name].setdefault(kind, {})[str(concurrency)] = merge(done)
    stack.restart_worker(extra_env={"ACE_PROD_PLAIN": "true"})  # the same path at K = 0: the engine's plain decoding
    stack.restart_ace(extra_env={"ACE_GOODPUT_GUARD": "false"})  # every K = 0 request on the engine
    mode("plain")
    run_once(stack, prompts[:1], concurrency=1, max_tokens=max_tokens, sampling={}, prod=True)  # warm: load models
    measured["plain"] = {kind: {str(c): merge([one("plain", kind, c, 0)]) for c in loads} for kind in SAMPLINGS}
    return measured


def reason_key(record: dict) -> str:
    """A record's action and reason without the figures that differ per request (the guard's medians)."""
    reason = (record.get("reason") or "").split(": median ")[0]
    return f"{record['action']}: {reason}" if reason else record["action"]


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def shape(measured: dict[str, dict[str, dict[str, Run]]]) -> dict:
    """The bench's `concurrency` JSON: per traffic kind and concurrency, prod / off and prod / plain same path."""
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
                "guard_skipped": prod.guard_skipped,  # of `skipped`: sent plain by the goodput guard
                "reasons": dict(prod.reasons.most_common()),  # why each request speculated or went plain
                **_per_round(prod, off),
            }
            if kind == "greedy":
                same = sum(a == b for a, b in zip(prod.token_ids, off.token_ids, strict=True))
                out[kind][concurrency]["identical_to_off"] = f"{same} of {len(prod.token_ids)}"
    return out


def _per_round(prod: Run, off: Run) -> dict:
    """With rounds: prod / off per round (round i of each), their median, and in the last round, when the guard has
    learned."""
    if len(prod.rounds) < 2 or len(off.rounds) != len(prod.rounds):
        return {}
    ratios = [_ratio(p.tok_s, o.tok_s) for p, o in zip(prod.rounds, off.rounds, strict=True)]
    return {
        "rounds": len(prod.rounds),
        "prod_over_off_per_round": ratios,
        "prod_over_off_last_round": ratios[-1],
        # robust to one round of either mode in which the server stalled (vLLM's CPU build does, in off as in prod:
        # docs/BENCHMARKS.md), which the aggregate tokens / seconds weighs by its length
        "prod_over_off_median_round": statistics.median(r for r in ratios if r is not None) if any(ratios) else None,
        # the mean of the per-round ratios and its 90 % Student-t interval: whether prod is told apart from off at
        # this load (two rounds of off alone differed by a ratio sd of 0.12 at 8 streams here: docs/BENCHMARKS.md)
        **_mean_interval([r for r in ratios if r is not None]),
        "guard_skipped_per_round": [p.guard_skipped for p in prod.rounds],
        "speculated_per_round": [p.outcomes.get("speculated", 0) for p in prod.rounds],
        "reasons_per_round": [dict(p.reasons.most_common()) for p in prod.rounds],
    }


# Student's t, upper 5 % point, for 1-10 degrees of freedom (a two-sided 90 % interval); beyond, 1.8
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812)


def _mean_interval(ratios: list[float]) -> dict:
    """{"prod_over_off_mean_round": mean, "prod_over_off_interval_90": [low, high]} of per-round ratios (two or
    more), the interval from Student's t: the rounds are few and their spread is the machine's."""
    if len(ratios) < 2:
        return {}
    mean = statistics.mean(ratios)
    t = _T95[len(ratios) - 2] if len(ratios) - 1 <= len(_T95) else 1.8
    half = t * statistics.stdev(ratios) / len(ratios) ** 0.5
    return {
        "prod_over_off_mean_round": round(mean, 4),
        "prod_over_off_interval_90": [round(mean - half, 4), round(mean + half, 4)],
    }


def shadow_vs_prod(shadow: list[dict], prod: list[dict]) -> dict:
    """Median of shadow-projected / prod-measured multiplier over the requests both measured, paired in order, and
    the ratio's factors (`split`), each the median over the pairs that carry it."""
    records = [
        (s, p)
        for s, p in zip(sorted(shadow, key=lambda r: r["id"]), sorted(prod, key=lambda r: r["id"]), strict=False)
        if s.get("multiplier") and p.get("multiplier")
    ]
    pairs = [(s["multiplier"], p["multiplier"]) for s, p in records]
    ratios = [s / p for s, p in pairs]
    splits = [split(s, p) for s, p in records]

    def median(key: str) -> float | None:
        values = [row[key] for row in splits if row.get(key) is not None]
        return round(statistics.median(values), 4) if values else None

    return {
        "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
        "requests": len(ratios),
        "shadow_median": round(statistics.median(s for s, _ in pairs), 4) if pairs else None,
        "prod_median": round(statistics.median(p for _, p in pairs), 4) if pairs else None,
        **{key: median(key) for key in SPLIT_KEYS},
    }


SPLIT_KEYS = ("worker_side", "tokens_side", "plain_side", "projected_worker_step_ms", "prod_worker_step_ms")


def split(shadow: dict, prod: dict) -> dict:
    """shadow / prod = tokens side x worker side x plain side, for one pair of records:
    - worker side: prod's measured worker step (tokens / verification steps over the rate its multiplier is
      from: its decode rate over the stored step, else its tok/s) over the projected one (v(K) + K c in seconds:
      E[N] x server step / S, E[N] the tokens per step the projection used: the replay's tokens per target pass,
      its last steps' smaller K included; a record without them, its mean accepted length);
    - tokens side: tokens per step as shadow projected them over prod's (tokens / verification steps);
    - plain side: the server step shadow's projection is over / the one prod's multiplier is over (1 when both
      are the same stored calibration; None where a record has none: it was over an end-to-end baseline)."""
    out: dict = {}
    s_step, p_step = shadow.get("server_step_ms"), prod.get("server_step_ms")
    s_passes, s_tokens = shadow.get("target_passes"), shadow.get("output_tokens")
    tau = s_tokens / s_passes if s_passes and s_tokens else shadow.get("mean_accepted_len") or 1.0
    passes, tokens, tok_s = prod.get("target_passes"), prod.get("output_tokens"), prod.get("tok_s")
    if s_step and p_step:
        out["plain_side"] = s_step / p_step
    if s_step:
        out["projected_worker_step_ms"] = tau * s_step / shadow["multiplier"]
    if passes and tokens and (p_step or tok_s):  # the rate prod's multiplier is from: over its step, else tok/s
        rate = prod["multiplier"] / p_step * 1000.0 if p_step else tok_s
        out["prod_worker_step_ms"] = tokens / rate / passes * 1000.0
        out["tokens_side"] = tau / (tokens / passes)
    if "projected_worker_step_ms" in out and "prod_worker_step_ms" in out:
        out["worker_side"] = out["prod_worker_step_ms"] / out["projected_worker_step_ms"]
    return out


def wait_new_records(
    stack: BenchStack, endpoint: str, mode: str, *, seen: set, count: int, timeout_s: float = 300
) -> list[dict]:
    """The endpoint's records of `mode` not in `seen`, once there are `count` of them (or at the timeout). Counted by
    id: the API returns the newest 1000, so with more records in all a total count would never grow (a 6-round run
    has about 1000 prod records by its K = 0 phase, whose every wait then ran into the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        new = [r for r in stack.records(endpoint, mode=mode) if r["id"] not in seen]
        if len(new) >= count or time.monotonic() > deadline:
            return new
        time.sleep(0.5)
