"""Baseline tok/s of an endpoint: measured, never assumed.

A calibration run: the endpoint generates plainly (greedy, end-of-sequence ignored where the server kind
allows it; the request and the reading of its answer come from the kind's adapter, fleet.adapters.wire) for
the request's own prompt, timed end to end, and the rate is kept in Redis for BASELINE_TTL_S. Prod records
compare their tok/s with it; plain traffic the stage sees (skipped, fell back) records its own tok/s too.
"""

from __future__ import annotations

import json
import logging
import time

import httpx
import redis

from fleet.adapters import wire_for

logger = logging.getLogger(__name__)

BASELINE_TTL_S = 600
CALIBRATION_TOKENS = 32


def _key(endpoint_id: int) -> str:
    return f"ace:baseline:{endpoint_id}"


def calibrate(
    *,
    client: httpx.Client,
    base_url: str,
    kind: str,
    model: str,
    headers: dict[str, str],
    prompt_ids: list[int],
    max_tokens: int,
) -> float:
    wire = wire_for(kind)
    request = wire.baseline(model=model, prompt=prompt_ids, max_tokens=max(1, min(CALIBRATION_TOKENS, max_tokens)))
    started = time.perf_counter()
    response = client.request(
        request.method, base_url.rstrip("/") + request.path, json=request.json, headers=headers, timeout=120
    )
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return wire.parse_baseline(response.json()) / elapsed


def baseline_tok_s(*, redis_client: redis.Redis, endpoint_id: int, measure) -> float | None:
    """The cached baseline, or a fresh calibration (`measure()`); None when it cannot be measured now."""
    try:
        cached = redis_client.get(_key(endpoint_id))
        if cached:
            return float(json.loads(cached)["tok_s"])
    except (redis.RedisError, ValueError, KeyError) as exc:
        logger.warning("baseline cache unreadable: %s", exc)
    try:
        value = measure()
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        logger.warning("calibration of endpoint %s failed: %s", endpoint_id, exc)
        return None
    try:
        redis_client.set(_key(endpoint_id), json.dumps({"tok_s": value, "at": time.time()}), ex=BASELINE_TTL_S)
    except redis.RedisError:
        pass
    return value
