"""The gateway's side of admission control and cancellation (speculation.jobs.admission has the design).

``admit`` takes a prod slot on the endpoint's node class or says the workers are at capacity; ``cancel`` tells
the worker to stop a job (the client went away, or the gateway stopped waiting) and frees its slot.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from speculation.gateway import background
from speculation.gateway.channel import ChannelError, client
from speculation.jobs.admission import ADMIT_LUA, CANCEL_TTL_S, cancel_key, inflight_key, workers_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admission:
    admitted: bool
    declared: bool  # some worker declared capacity for this node class
    in_flight: int
    capacity: int

    def reason(self, node_class: str) -> str:
        return f"worker at capacity: {self.in_flight} of {self.capacity} prod slots on gpu.{node_class} in use"


async def admit(*, node_class: str, request_id: str, hold_s: float) -> Admission:
    """Take a slot for this job, atomically with the count. Without any declared worker the job is let through
    (the start timeout then decides), so a worker that declares nothing still serves."""
    try:
        status, busy, capacity = await client().eval(
            ADMIT_LUA, 2, workers_key(node_class), inflight_key(node_class), request_id, hold_s
        )
    except (aioredis.RedisError, OSError) as exc:
        raise ChannelError(f"redis unavailable: {type(exc).__name__}: {exc}") from exc
    status = int(status)
    return Admission(admitted=status != 0, declared=status != -1, in_flight=int(busy), capacity=int(capacity))


async def _cancel(node_class: str, request_id: str) -> None:
    pipe = client().pipeline(transaction=False)
    pipe.set(cancel_key(request_id), 1, ex=CANCEL_TTL_S)
    pipe.zrem(inflight_key(node_class), request_id)
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
