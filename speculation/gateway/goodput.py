"""The goodput guard: prod serves a request plain where speculating it is predicted slower than plain serving.

Per request, the cost model (guard.costs: measured step costs, E[N], the setup per request) predicts the gain of a
request of its expected length, corrected by the goodput measured for that traffic kind, load and length
(guard.rules.by_cost); above one request in flight the measured goodput of the load also decides what neighbours
pay (guard.rules.choose), as it decides at every load while no cost model is measured. Samples: guard.samples;
in-flight counting: guard.load; where the worker runs: guard.topology. Every decision carries its reason, kept in
the stage record. ACE_GOODPUT_GUARD=false turns it off. Measurements: docs/BENCHMARKS.md, "Concurrency".
"""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis
from django.conf import settings

from speculation.gateway.call import Call
from speculation.gateway.guard import costs, load, rules, topology
from speculation.gateway.guard import samples as store
from speculation.gateway.guard.load import RECENT_S, begin, end
from speculation.gateway.guard.rules import (
    BUCKET_NAMES,
    GREEDY,
    MIN_SAMPLES,
    PLAIN,
    SAMPLED,
    SPEC,
    CostModel,
    Decision,
    Samples,
    bucket_of,
)
from speculation.gateway.guard.samples import KEY
from speculation.gateway.sse import TokenCount
from speculation.models import Mode

logger = logging.getLogger(__name__)

# What callers use, the guard's parts' names included (tests and benches read the same constants).
__all__ = [
    "GREEDY", "KEY", "MIN_SAMPLES", "PLAIN", "RECENT_S", "SPEC", "PlainSample", "begin", "bucket_of", "choose",
    "decide", "end", "observe", "reconsider", "watch",
]  # fmt: skip


def choose(samples: Samples, **load_state: Any) -> Decision:
    """The load's rule (guard.rules.choose) with at most ACE_GOODPUT_SPECULATING requests speculating at once."""
    return rules.choose(samples, cap=settings.GOODPUT_SPECULATING, **load_state)


def _rule(
    call: Call,
    samples: Samples,
    *,
    bucket: str,
    turn: int,
    shared: bool,
    batched: bool,
    tokens: int | None,
    model: CostModel | None,
) -> Decision:
    """The request's cost rule where a cost model and its length are known, else (or where it leaves the decision
    to the load above one request in flight) the load's rule."""
    endpoint_id, traffic = call.route.endpoint_id, call.traffic
    if model is not None and tokens:
        decided = rules.by_cost(
            samples, model, tokens=tokens, traffic=traffic, bucket=bucket, turn=turn, batched=batched
        )
        if decided is not None:
            return decided
    return choose(
        samples, traffic=traffic, bucket=bucket, turn=turn, learning=load.learning(endpoint_id),
        speculating=load.speculating(endpoint_id), pending=load.pending(endpoint_id, call.request_id),
        held=load.hold_slower(endpoint_id, samples, traffic=traffic, bucket=bucket, batched=batched), shared=shared,
        batched=batched,
    )  # fmt: skip


async def decide(call: Call, *, tokens: int | None = None) -> Decision:
    """Begin the request (count it in flight) and say whether it speculates; `tokens`: its expected output length
    (its max tokens), for the cost rule. With the guard off it always speculates."""
    bucket = begin(call)
    if not settings.GOODPUT_GUARD:
        return Decision(plain=False)
    endpoint_id = call.route.endpoint_id
    try:
        samples = await store.read(endpoint_id, store.pairing_of(call.route))
        shared = await topology.shares_machine(call.route)
    except (aioredis.RedisError, OSError) as exc:  # no measurement: speculate as without the guard
        logger.warning("goodput guard: Redis unavailable (%s)", exc)
        return Decision(plain=False)
    # the peak again: requests of a burst that arrived during the read count (the first would be decided alone)
    peak = load.peak(endpoint_id)
    try:  # not where the worker shares the server's machine: measured no faster there, and learning costs a round
        batched = not shared and await topology.batch_takes(call.route, peak)
    except (aioredis.RedisError, OSError):
        batched = False
    call.load_bucket = bucket = bucket_of(peak)
    model = await costs.cost_model(call.route) if tokens else None
    turn = load.turn(endpoint_id, call.traffic, bucket)
    decision = _rule(
        call, samples, bucket=bucket, turn=turn, shared=shared, batched=batched, tokens=tokens, model=model
    )
    load.mark(call, decision)
    return Decision(
        decision.plain, decision.reason, decision.probe, samples=samples, shared=shared, batched=batched,
        tokens=tokens, model=model,
    )  # fmt: skip


def reconsider(call: Call, decision: Decision) -> Decision:
    """Just before a speculating request goes to the worker (after tokenizing): if the endpoint's peak load rose into
    a higher bucket since it was decided (the rest of a burst arrived meanwhile), the rules again at that load, on
    what it was decided on (no second Redis read). The first request of a burst is otherwise decided alone."""
    endpoint_id = call.route.endpoint_id
    bucket = bucket_of(load.peak(endpoint_id))
    if decision.plain or decision.samples is None or not call.load_bucket:
        return decision
    if BUCKET_NAMES.index(bucket) <= BUCKET_NAMES.index(call.load_bucket):
        return decision
    load.mark(call, Decision(plain=True))  # not counted as learning while it is decided again
    batched = decision.batched and topology.batch_takes_known(call.route.node_class, load.peak(endpoint_id))
    again = _rule(
        call, decision.samples, bucket=bucket, turn=0, shared=decision.shared, batched=batched,
        tokens=decision.tokens, model=decision.model,
    )  # fmt: skip
    call.load_bucket = bucket
    if again.plain:
        again = Decision(plain=True, reason=f"{again.reason}; the load rose to {bucket} while it was prepared")
    load.mark(call, again)
    return again


async def observe(call: Call, *, kind: str, tokens: int | None, latency_ms: float, later: bool = False) -> None:
    """Keep a finished request's tok/s in its sample (kind SPEC or PLAIN) at the mean load it ran under, and count
    it out of flight. `later`: a plain sample is written with the next batch (store.keep_later), as an off
    request's is; a speculative one always at once (other processes judge the pairing by it)."""
    name = _finished(call, kind=kind, tokens=tokens, latency_ms=latency_ms)
    if name is None:
        return
    if later and name[2] == PLAIN:  # written with the others of the next moment, as off's samples are
        store.keep_later(call.route.endpoint_id, name, tokens=tokens, seconds=latency_ms / 1000.0)  # type: ignore[arg-type]
        return
    try:
        await store.keep(call.route.endpoint_id, name, tokens=tokens, seconds=latency_ms / 1000.0)
    except (aioredis.RedisError, OSError) as exc:
        logger.warning("goodput guard: could not keep a sample (%s)", exc)


def _finished(call: Call, *, kind: str, tokens: int | None, latency_ms: float) -> store.Name | None:
    """Count the request out of flight; the sample it is kept in (None: no sample to keep)."""
    if kind == PLAIN and load.beside_only(call):
        kind = SPEC  # what speculating at this load cost a plain neighbour: part of speculation's goodput
    mean_load = end(call)
    bucket = bucket_of(max(1, round(mean_load))) if mean_load is not None else getattr(call, "load_bucket", "")
    if not bucket or not tokens or latency_ms <= 0:
        return None
    return (call.traffic or SAMPLED, bucket, kind)


class PlainSample:
    """Observer of an off or shadow request (wrapping shadow's own, if any): its tok/s becomes a plain sample, its
    tokens counted by TokenCount."""

    def __init__(self, call: Call, inner: Any = None) -> None:
        self.call = call
        self.inner = inner
        self.count = TokenCount(call.kind)

    def on_body(self, status: int, body: bytes) -> bytes:
        self.count.body(body)
        return self.inner.on_body(status, body) if self.inner is not None else body

    def on_chunk(self, chunk: bytes) -> bytes:
        self.count.chunk(chunk)
        return self.inner.on_chunk(chunk) if self.inner is not None else chunk

    def tokens(self) -> int:
        return self.count.tokens()

    async def on_done(self, status: int, error: str = "") -> None:
        if self.inner is not None:
            await self.inner.on_done(status, error)
        tokens = self.tokens()
        if status != 200 or error or not tokens:
            end(self.call)
            return
        latency_ms = self.call.elapsed_ms()
        name = _finished(self.call, kind=PLAIN, tokens=tokens, latency_ms=latency_ms)
        if name is not None:  # written with the others of the next moment (store.keep_later)
            store.keep_later(self.call.route.endpoint_id, name, tokens=tokens, seconds=latency_ms / 1000.0)


def watch(call: Call, observer: Any = None) -> Any:
    """For an off or shadow request with the guard on: count it in flight and wrap its observer so that its tok/s
    is kept as a plain sample. Prod requests record their own samples (the observer is returned as it is)."""
    if not settings.GOODPUT_GUARD or call.route.mode == Mode.PROD:
        return observer
    begin(call)
    return PlainSample(call, observer)
