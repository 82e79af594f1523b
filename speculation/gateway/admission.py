"""The gateway's side of admission control and cancellation (speculation.jobs.admission has the design).

``admit`` takes a prod slot on the endpoint's node class or says the workers are at capacity; ``cancel`` tells
the worker to stop a job (the client went away, or the gateway stopped waiting) and frees its slot.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from speculation import drafting
from speculation.gateway import background
from speculation.gateway.channel import ChannelError, client
from speculation.jobs.admission import (
    ADMIT_LUA,
    CANCEL_TTL_S,
    cancel_key,
    inflight_key,
    single_inflight_key,
    single_workers_key,
    workers_key,
)
from speculation.models import VerificationPath

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admission:
    admitted: bool
    declared: bool  # some worker declared capacity for this node class
    in_flight: int
    capacity: int
    single: bool = False  # counted among the single-stream jobs

    def reason(self, node_class: str) -> str:
        slots = "single-stream prod slots (remote path, EAGLE)" if self.single else "prod slots"
        return f"worker at capacity: {self.in_flight} of {self.capacity} {slots} on gpu.{node_class} in use"


def single_stream(*, path: str, mechanism: str) -> bool:
    """Whether the worker runs this job alone rather than in its batch (speculation.worker.batching.serves: the
    batch serves the local path with a draft model, n-gram lookup, suffix decoding or the hybrid of suffix decoding
    with a draft's fallback; not an EAGLE head)."""
    return path != VerificationPath.LOCAL or mechanism not in drafting.BATCHED_KINDS


async def _admit(workers: str, inflight: str, request_id: str, hold_s: float) -> tuple[int, int, int]:
    try:
        status, busy, capacity = await client().eval(ADMIT_LUA, 2, workers, inflight, request_id, hold_s)
    except (aioredis.RedisError, OSError) as exc:
        raise ChannelError(f"redis unavailable: {type(exc).__name__}: {exc}") from exc
    return int(status), int(busy), int(capacity)


async def admit(*, node_class: str, request_id: str, hold_s: float, single: bool = False) -> Admission:
    """Take a slot for this job, atomically with the count (a single-stream job: among the single-stream jobs where
    the workers declare them apart, else with the rest). Without any declared worker the job is let through (the
    start timeout then decides), so a worker that declares nothing still serves."""
    if single:
        status, busy, capacity = await _admit(
            single_workers_key(node_class), single_inflight_key(node_class), request_id, hold_s
        )
        if status != -1:
            return Admission(admitted=status == 1, declared=True, in_flight=busy, capacity=capacity, single=True)
    status, busy, capacity = await _admit(workers_key(node_class), inflight_key(node_class), request_id, hold_s)
    return Admission(admitted=status != 0, declared=status != -1, in_flight=busy, capacity=capacity)


async def _cancel(node_class: str, request_id: str) -> None:
    pipe = client().pipeline(transaction=False)
    pipe.set(cancel_key(request_id), 1, ex=CANCEL_TTL_S)
    pipe.zrem(inflight_key(node_class), request_id)
    pipe.zrem(single_inflight_key(node_class), request_id)
    await pipe.execute()


def cancel(*, node_class: str, request_id: str) -> None:
    """Ask the worker to stop this job and free its slot; safe to call from a cancelled task's cleanup."""
    try:
        background.spawn(_cancel(node_class, request_id), what=f"cancel of prod job {request_id}")
    except RuntimeError:  # no running loop (shutdown): the slot expires by itself
        logger.warning("could not cancel prod job %s", request_id)


async def cancel_now(*, node_class: str, request_id: str) -> None:
    try:
        await asyncio.shield(_cancel(node_class, request_id))
    except (aioredis.RedisError, OSError) as exc:
        logger.warning("could not cancel prod job %s: %s", request_id, exc)
