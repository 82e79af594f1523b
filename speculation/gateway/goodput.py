"""The goodput guard: prod does not speculate at a load where speculation measured slower than plain serving.

Whether speculation pays depends on the load: a server that batches well answers 32 streams far faster than one,
while the worker's engine may not. So per endpoint and load bucket (how many of the endpoint's prod requests this
web process has in flight when one starts: 1, 2-4, 5-16, 17+), the guard keeps the tok/s of the newest WINDOW
requests served speculatively and of the newest WINDOW served plainly (Redis lists, shared by web processes).

- Both have MIN_SAMPLES and speculation's median is below plain's: the request goes plain (`skipped`, the reason
  gives both medians), except every EXPLORE_EVERY-th request, which still speculates, so that a change (another
  draft, another K, a quieter machine) is seen.
- Speculation has MIN_SAMPLES but plain has fewer: every other request goes plain to measure it ("measuring plain
  speed at this load"; a plain request is served as off serves it, so measuring costs the client nothing);
  requests the workers had no slot for count as plain samples too.
- Otherwise the request speculates.

ACE_GOODPUT_GUARD=false turns it off (the tests of speculation itself do, so that their requests speculate).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import redis.asyncio as aioredis
from django.conf import settings

from speculation.gateway.call import Call
from speculation.gateway.channel import client

logger = logging.getLogger(__name__)

WINDOW = 20
MIN_SAMPLES = 8
EXPLORE_EVERY = 10
BUCKETS = ((1, "1"), (4, "2-4"), (16, "5-16"))
TOP_BUCKET = "17+"
KEY = "ace:goodput:{endpoint_id}:{bucket}:{kind}"
EXPIRE_S = 3600
STALE_S = 900.0  # an in-flight entry older than this was lost (its record never written): no longer counted

SPEC = "spec"
PLAIN = "plain"

_in_flight: dict[int, dict[str, float]] = defaultdict(dict)
_turns: dict[tuple[int, str], itertools.count] = defaultdict(itertools.count)


@dataclass(frozen=True)
class Decision:
    plain: bool
    reason: str = ""


def bucket_of(in_flight: int) -> str:
    for bound, name in BUCKETS:
        if in_flight <= bound:
            return name
    return TOP_BUCKET


def begin(call: Call) -> str:
    """Count the request in flight for its endpoint; its load bucket (the request itself included)."""
    now = time.monotonic()
    flying = _in_flight[call.route.endpoint_id]
    for request_id, started in list(flying.items()):
        if now - started > STALE_S:
            del flying[request_id]
    flying[call.request_id] = now
    call.load_bucket = bucket_of(len(flying))
    return call.load_bucket


def end(call: Call) -> None:
    _in_flight[call.route.endpoint_id].pop(call.request_id, None)


def choose(*, spec: list[float], plain: list[float], turn: int) -> Decision:
    """The rule, on the two samples of one endpoint and bucket and this request's turn among them."""
    explore = turn % EXPLORE_EVERY == EXPLORE_EVERY - 1
    if len(spec) < MIN_SAMPLES:
        return Decision(plain=False)
    if len(plain) < MIN_SAMPLES:
        if turn % 2 == 1:
            return Decision(plain=True, reason="measuring plain speed at this load (goodput guard)")
        return Decision(plain=False)
    spec_median, plain_median = statistics.median(spec), statistics.median(plain)
    if spec_median >= plain_median or explore:
        return Decision(plain=False)
    return Decision(
        plain=True,
        reason=(
            f"speculation measured slower than plain at this load (goodput guard): median {spec_median:.1f} vs "
            f"{plain_median:.1f} tok/s per request over the last {len(spec)} / {len(plain)} requests"
        ),
    )


async def decide(call: Call) -> Decision:
    """Begin the request (count it in flight) and say whether it speculates. Plain when the guard is off never."""
    bucket = begin(call)
    if not settings.GOODPUT_GUARD:
        return Decision(plain=False)
    endpoint_id = call.route.endpoint_id
    try:
        pipe = client().pipeline(transaction=False)
        for kind in (SPEC, PLAIN):
            pipe.lrange(KEY.format(endpoint_id=endpoint_id, bucket=bucket, kind=kind), 0, WINDOW - 1)
        spec_raw, plain_raw = await pipe.execute()
    except (aioredis.RedisError, OSError) as exc:  # no measurement: speculate as without the guard
        logger.warning("goodput guard: Redis unavailable (%s)", exc)
        return Decision(plain=False)
    turn = next(_turns[(endpoint_id, bucket)])
    return choose(spec=[float(v) for v in spec_raw], plain=[float(v) for v in plain_raw], turn=turn)


async def observe(call: Call, *, kind: str, tokens: int | None, latency_ms: float) -> None:
    """Keep a finished request's tok/s in its bucket's sample (kind SPEC or PLAIN) and count it out of flight."""
    end(call)
    bucket = getattr(call, "load_bucket", "")
    if not bucket or not tokens or latency_ms <= 0:
        return
    key = KEY.format(endpoint_id=call.route.endpoint_id, bucket=bucket, kind=kind)
    try:
        pipe = client().pipeline(transaction=False)
        pipe.lpush(key, round(tokens / (latency_ms / 1000.0), 3))
        pipe.ltrim(key, 0, WINDOW - 1)
        pipe.expire(key, EXPIRE_S)
        await pipe.execute()
    except (aioredis.RedisError, OSError) as exc:
        logger.warning("goodput guard: could not keep a sample (%s)", exc)
