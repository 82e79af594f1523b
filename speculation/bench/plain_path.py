"""python -m speculation.bench.plain_path [--n N] [--tokens T] [--blocks B] [--json PATH]

What a prod request that goes plain costs the gateway, against an off request. At a load where speculation does not
pay (8 streams on the 2-core bench machine) the goodput guard sends every prod request plain, so prod is as fast as
off only if that path costs the web process no more than off's. Both are streamed completions of T events from a
model server that answers at once (speculation.bench.fake_upstream), sent through `ace.asgi.application` in this
process one at a time (as gateway_overhead --profile drives it), and measured in CPU time of this process: every
thread, the database thread that writes the stage record included, with each request's background work (its
goodput sample, its stage record) awaited before the next. Prod is sent plain by the guard's rule on kept samples
(speculation measured slower at one request in flight), as a loaded endpoint's prod requests are. Blocks of off
and of prod alternate, each mode first in every other pair, so that a drift falls on both.

Everything runs on a throw-away SQLite database and Redis (gateway_overhead's Stack), stopped at the end.
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

from speculation.bench.gateway_overhead import Stack
from speculation.bench.gateway_profile import _scope, exchange


async def _one(app, scope: dict, raw: bytes) -> tuple[int, int]:
    """One request through the ASGI app; its status and the number of body bytes it streamed."""
    sent = await exchange(app, scope, raw)
    return sent[0]["status"], sum(len(m.get("body", b"")) for m in sent[1:])


async def _block(app, token: str, raw: bytes, n: int, concurrency: int = 1) -> tuple[float, list[float]]:
    """n requests, `concurrency` at a time; the CPU seconds of this process over them (their background work
    included) and each one's wall seconds."""
    from speculation.gateway import background

    scope = _scope(token, raw)
    walls: list[float] = []
    left = [n]

    async def stream() -> None:
        while left[0] > 0:
            left[0] -= 1
            started = time.perf_counter()
            status, streamed = await _one(app, dict(scope), raw)
            walls.append(time.perf_counter() - started)
            if status != 200 or not streamed:
                raise RuntimeError(f"the gateway answered {status} ({streamed} bytes)")

    cpu = time.process_time()
    await asyncio.gather(*(stream() for _ in range(concurrency)))
    while background._pending:
        await asyncio.gather(*list(background._pending), return_exceptions=True)
    return time.process_time() - cpu, walls


def _prod_goes_plain(endpoint_id: int, concurrency: int) -> None:
    """Samples that make the guard send the endpoint's greedy prod requests plain at one request in flight and at
    the load `concurrency` makes."""
    import redis
    from django.conf import settings

    from speculation.gateway import goodput

    client = redis.Redis.from_url(settings.REDIS_URL)
    for bucket in {"1", goodput.bucket_of(concurrency)}:
        for kind, tok_s in ((goodput.SPEC, 5.0), (goodput.PLAIN, 500.0)):
            key = goodput.KEY.format(endpoint_id=endpoint_id, traffic=goodput.GREEDY, bucket=bucket, kind=kind)
            client.delete(key)
            client.lpush(key, *[f"{tok_s:.3f}:1.000"] * goodput.MIN_SAMPLES)


def run(*, token: str, n: int, tokens: int, blocks: int, concurrency: int) -> dict:
    import django

    django.setup()
    from asgiref.sync import sync_to_async

    from ace.asgi import application
    from fleet.models import Endpoint
    from speculation.models import StageRecord
    from speculation.services.policies import get_policy

    endpoint = Endpoint.objects.get(name="fake")
    policy = get_policy(endpoint=endpoint)
    policy.mechanism, policy.path, policy.k = "ngram", "local", 5
    _prod_goes_plain(endpoint.pk, concurrency)
    raw = json.dumps({"model": "fake", "prompt": "def f():", "max_tokens": tokens, "temperature": 0, "stream": True})
    per_block = max(1, n // blocks)
    cpu: dict[str, float] = {"off": 0.0, "prod": 0.0}
    walls: dict[str, list[float]] = {"off": [], "prod": []}
    counts = {"off": 0, "prod": 0}

    def save_mode(mode: str) -> None:
        policy.mode = mode
        policy.save()  # bumps the gateway's version: the next request rebuilds its route table

    async def switch(mode: str) -> None:
        await sync_to_async(save_mode, thread_sensitive=True)(mode)

    async def drive() -> None:
        for mode in ("off", "prod"):  # warm-up: connections, the route table, imports
            await switch(mode)
            await _block(application, token, raw.encode(), 10)
        for index in range(blocks):
            for mode in ("off", "prod") if index % 2 == 0 else ("prod", "off"):
                await switch(mode)
                await _block(application, token, raw.encode(), 1)  # the route table rebuilt after the switch
                spent, timed = await _block(application, token, raw.encode(), per_block, concurrency)
                cpu[mode] += spent
                walls[mode] += timed
                counts[mode] += per_block

    before = StageRecord.objects.count()
    asyncio.run(drive())
    records = StageRecord.objects.order_by("-id")[: counts["prod"]]
    skipped = sum(1 for r in records if r.action == "skipped" and "goodput guard" in r.reason)
    out = {
        mode: {
            "requests": counts[mode],
            "cpu_ms_per_request": round(cpu[mode] * 1000 / counts[mode], 3),
            "wall_ms_p50": round(statistics.median(walls[mode]) * 1000, 3),
        }
        for mode in ("off", "prod")
    }
    out["prod_minus_off_cpu_ms"] = round(out["prod"]["cpu_ms_per_request"] - out["off"]["cpu_ms_per_request"], 3)
    out["prod_over_off_cpu"] = round(out["prod"]["cpu_ms_per_request"] / out["off"]["cpu_ms_per_request"], 4)
    out["prod_records"] = {"written": StageRecord.objects.count() - before, "skipped_by_the_guard": skipped}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--n", type=int, default=400, help="requests per mode (default 400)")
    parser.add_argument("--tokens", type=int, default=64, help="streamed events per request (default 64)")
    parser.add_argument("--blocks", type=int, default=8, help="alternating blocks per mode (default 8)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="requests in flight at once (default 1; the guard's rule is fed "
        "samples at load 1 and at the load this makes)",
    )
    parser.add_argument("--json", dest="json_path", help="write the results there as JSON")
    args = parser.parse_args()
    if min(args.n, args.tokens, args.blocks, args.concurrency) < 1 or args.blocks > args.n:
        parser.error("--n, --tokens, --blocks and --concurrency must be at least 1, and --blocks at most --n")
    stack = Stack().start()
    try:
        os.environ.update(stack.env)
        results = run(token=stack.token, n=args.n, tokens=args.tokens, blocks=args.blocks, concurrency=args.concurrency)
    finally:
        stack.stop()
    results["meta"] = {
        "n": args.n,
        "tokens": args.tokens,
        "blocks": args.blocks,
        "concurrency": args.concurrency,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load": os.getloadavg(),
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.json_path:
        Path(args.json_path).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
