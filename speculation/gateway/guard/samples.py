"""The goodput samples in Redis: per endpoint, traffic kind, load bucket and side (SPEC / PLAIN), the newest WINDOW
finished requests as "tok/s:seconds", shared by the web processes.

The plain sample of every off and shadow request is written with the others of the next FLUSH_S in one pipeline
(`keep_later`): one round trip each was most of what the guard cost an off request. Other processes read them at
most FLUSH_S later (they reuse what they read for READ_TTL_S anyway); this one sees them at once.

Speculative lists expire SPEC_TTL_S after their first sample (a changed draft or machine is learned again), plain
ones EXPIRE_S after their newest. A process reuses what it read for READ_TTL_S, with the samples it keeps itself
added as it keeps them: reading every list per prod request would be most of a plain prod request's cost.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from speculation.gateway import background
from speculation.gateway.channel import client
from speculation.gateway.guard.rules import BUCKET_NAMES, PLAIN, SPEC, SPEC_TTL_S, TRAFFIC, WINDOW, Sample

KEY = "ace:goodput:{endpoint_id}:{traffic}:{bucket}:{kind}"
# What prod ran when the endpoint's speculative samples were kept (path, mechanism, draft, K): another pairing's
# speed says nothing of this one's, so its samples are dropped when the route's pairing differs.
PAIRING_KEY = "ace:goodput:{endpoint_id}:pairing"
EXPIRE_S = 3600  # plain samples: refreshed with every sample
READ_TTL_S = 1.0
FLUSH_S = 0.25
NAMES = tuple((traffic, bucket, kind) for traffic in TRAFFIC for bucket in BUCKET_NAMES for kind in (SPEC, PLAIN))
Name = tuple[str, str, str]  # (traffic, bucket, SPEC | PLAIN)

logger = logging.getLogger(__name__)

_read_cache: dict[int, tuple[float, dict[Name, list[Sample]], str]] = {}


def pairing_of(route) -> str:
    """What prod speculates with on this route: its samples are comparable only under the same pairing."""
    parts = [getattr(route, name, "") for name in ("path", "mechanism", "draft_id", "k")]
    parts.append(int(bool(getattr(route, "dynamic_k", False))))
    return ":".join(str(part) for part in parts)


async def read(endpoint_id: int, pairing: str = "") -> dict[Name, list[Sample]]:
    """The endpoint's kept samples, newest first, per (traffic, bucket, kind); from this process's copy when it was
    read within READ_TTL_S. With `pairing` (pairing_of the route): speculative samples kept under another pairing
    are deleted first (the new pairing is learned afresh; plain ones stay)."""
    now = time.monotonic()
    found = _read_cache.get(endpoint_id)
    if found is not None and now - found[0] < READ_TTL_S and found[2] == pairing:
        return found[1]
    pipe = client().pipeline(transaction=False)
    pipe.get(PAIRING_KEY.format(endpoint_id=endpoint_id))
    for traffic, bucket, kind in NAMES:
        pipe.lrange(KEY.format(endpoint_id=endpoint_id, traffic=traffic, bucket=bucket, kind=kind), 0, WINDOW - 1)
    kept, *raws = await pipe.execute()
    samples = {name: [parse(v) for v in raw] for name, raw in zip(NAMES, raws, strict=True) if raw}
    kept = kept.decode() if isinstance(kept, bytes) else kept
    if pairing and kept != pairing:  # none kept yet: the samples there are taken for this pairing's
        await _adopt(endpoint_id, pairing, forget=kept is not None)
        if kept is not None:
            samples = {name: found for name, found in samples.items() if name[2] != SPEC}
    _read_cache[endpoint_id] = (now, samples, pairing)
    return samples


async def _adopt(endpoint_id: int, pairing: str, *, forget: bool) -> None:
    pipe = client().pipeline(transaction=False)
    for traffic, bucket, kind in NAMES:
        if forget and kind == SPEC:
            pipe.delete(KEY.format(endpoint_id=endpoint_id, traffic=traffic, bucket=bucket, kind=kind))
    pipe.set(PAIRING_KEY.format(endpoint_id=endpoint_id), pairing)
    await pipe.execute()


async def keep(endpoint_id: int, name: Name, *, tokens: int, seconds: float) -> None:
    """Keep one finished request's sample (this process sees it at once; Redis errors are the caller's)."""
    _remember(endpoint_id, name, (tokens / seconds, seconds))
    pipe = client().pipeline(transaction=False)
    _push(pipe, endpoint_id, name, _value(tokens, seconds))
    await pipe.execute()


def _value(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.3f}:{seconds:.3f}"


def _push(pipe, endpoint_id: int, name: Name, *values: str) -> None:
    """Queue the commands that add `values` (oldest first) to a list on `pipe`."""
    traffic, bucket, kind = name
    key = KEY.format(endpoint_id=endpoint_id, traffic=traffic, bucket=bucket, kind=kind)
    pipe.lpush(key, *values)
    pipe.ltrim(key, 0, WINDOW - 1)
    if kind == SPEC:
        pipe.expire(key, SPEC_TTL_S, nx=True)  # from the first sample: the verdict lasts SPEC_TTL_S
    else:
        pipe.expire(key, EXPIRE_S)


class _Batch:
    """The samples waiting for the next write of one event loop (its Redis client belongs to it)."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, Name, int, float]] = []
        self.writer: asyncio.Task | None = None


_batches: dict[int, _Batch] = {}


def keep_later(endpoint_id: int, name: Name, *, tokens: int, seconds: float) -> None:
    """Keep a sample as `keep` does, written to Redis within FLUSH_S together with the others kept meanwhile
    (a background task: tests drain it; a Redis error is logged)."""
    _remember(endpoint_id, name, (tokens / seconds, seconds))
    batch = _batches.setdefault(id(asyncio.get_running_loop()), _Batch())
    batch.samples.append((endpoint_id, name, tokens, seconds))
    if batch.writer is None or batch.writer.done():
        batch.writer = background.spawn(_write_after(batch), what="goodput samples")


async def _write_after(batch: _Batch) -> None:
    while batch.samples:
        await asyncio.sleep(FLUSH_S)
        await _write(batch)


async def _write(batch: _Batch) -> None:
    samples, batch.samples = batch.samples, []
    if not samples:
        return
    lists: dict[tuple[int, Name], list[str]] = {}
    for endpoint_id, name, tokens, seconds in samples:
        lists.setdefault((endpoint_id, name), []).append(_value(tokens, seconds))
    pipe = client().pipeline(transaction=False)
    for (endpoint_id, name), values in lists.items():
        _push(pipe, endpoint_id, name, *values)
    try:
        await pipe.execute()
    except (aioredis.RedisError, OSError) as exc:
        logger.warning("goodput guard: could not keep %d samples (%s)", len(samples), exc)


async def aflush() -> None:
    """Write this event loop's waiting samples now (at shutdown)."""
    batch = _batches.get(id(asyncio.get_running_loop()))
    if batch is not None:
        await _write(batch)


def _remember(endpoint_id: int, name: Name, sample: Sample) -> None:
    """A sample this process kept, added to its copy of the endpoint's samples (a new list: a decision made on the
    copy keeps what it was decided on)."""
    found = _read_cache.get(endpoint_id)
    if found is not None:
        kept = {**found[1], name: [sample, *found[1].get(name, ())][:WINDOW]}
        _read_cache[endpoint_id] = (found[0], kept, found[2])


def forget() -> None:
    """Drop this process's copies: the next decision reads Redis (tests; a process that learns a list expired)."""
    _read_cache.clear()


def parse(raw: bytes | str) -> Sample:
    """A kept sample: "tok/s:seconds" (a bare tok/s, an older format, weighs 1 s)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    rate, _, seconds = text.partition(":")
    return (float(rate), float(seconds)) if seconds else float(rate)
