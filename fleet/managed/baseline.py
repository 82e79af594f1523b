"""The baseline of a managed endpoint's native multiplier: the same server without speculation, per load.

Measured by the supervisor on the active instance while it runs without speculation (off or shadow): for each
concurrency bucket c, c concurrent plain greedy completions of BASELINE_TOKENS tokens (end of sequence
ignored), each timed end to end like the gateway times a request; the bucket's baseline is their mean
per-stream tok/s. Kept on the ManagedServer until re-measured (on demand, or when a plain instance starts
and none is kept). A prod record on the native path takes the bucket of the server's load when the request
started (requests running + 1): the largest measured bucket not above it.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from fleet.adapters import wire_for

BUCKETS = (1, 4)
BASELINE_TOKENS = 32
BASELINE_PROMPT = "def fibonacci(n):\n"


def _one(base_url: str, kind: str, model: str) -> float:
    wire = wire_for(kind)  # the server kind's plain greedy request, end of sequence ignored
    request = wire.baseline(model=model, prompt=BASELINE_PROMPT, max_tokens=BASELINE_TOKENS)
    started = time.perf_counter()
    response = httpx.request(request.method, base_url + request.path, json=request.json, timeout=300)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return wire.parse_baseline(response.json()) / elapsed


def measure(*, base_url: str, kind: str, model: str, buckets: tuple[int, ...] = BUCKETS) -> dict[str, float]:
    """{bucket: mean per-stream tok/s at that many concurrent streams}."""
    result: dict[str, float] = {}
    for c in buckets:
        with ThreadPoolExecutor(max_workers=c) as pool:
            rates = list(pool.map(lambda _: _one(base_url, kind, model), range(c)))
        result[str(c)] = round(statistics.fmean(rates), 3)
    return result


def pick(buckets: dict[str, float], concurrency: int) -> tuple[int, float] | None:
    """The bucket for a request that started with `concurrency` requests on the server, and its baseline."""
    measured = sorted((int(c), tok_s) for c, tok_s in (buckets or {}).items() if tok_s)
    if not measured:
        return None
    below = [entry for entry in measured if entry[0] <= max(1, concurrency)]
    return below[-1] if below else measured[0]
