"""Admission control and cancellation of prod jobs, kept in Redis (shared by the gateway and the GPU workers).

- capacity: every GPU worker declares, per node class it consumes, how many prod jobs it runs at once
  (its process concurrency): ZADD ace:workers:<node_class> <expiry> "<hostname>|<concurrency>", refreshed
  every HEARTBEAT_S. The node class's capacity is the sum over members that have not expired.
- in flight: ZADD ace:inflight:<node_class> <deadline> <request_id>. The gateway adds it when it admits a
  job, atomically with the count (ADMIT, a Lua script on Redis's own clock); the worker pushes the deadline
  forward with every step and removes it when the job ends. A member past its deadline (a dead worker, an
  expired job) no longer counts. A request that finds every slot taken goes plain at once (skipped
  "worker at capacity") instead of waiting for a worker that is busy.
- single-stream jobs (the remote path, EAGLE heads: each runs alone, one at a time per worker process, not in the
  batch) have their own count, so that a queue of them does not take the batch's slots: a worker that batches
  also declares ace:workers:<node_class>:single "<hostname>|<processes>", and the gateway admits such a job
  against ace:inflight:<node_class>:single. Where no worker declares it (batching off: every job is one process's),
  they share the node class's count as before.
- cancel: SET ace:prod:cancel:<request_id> by the gateway when the client went away or it stopped waiting;
  the worker reads it before it starts and in the same round trip as every step's tokens, and stops.

The gateway side is speculation.gateway.admission (asyncio Redis); this module holds the names and the
worker side (synchronous redis-py).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis

logger = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
WORKER_TTL_S = 3 * HEARTBEAT_S
CANCEL_TTL_S = 600


def workers_key(node_class: str) -> str:
    return f"ace:workers:{node_class}"


def inflight_key(node_class: str) -> str:
    return f"ace:inflight:{node_class}"


def single_workers_key(node_class: str) -> str:
    return f"ace:workers:{node_class}:single"


def single_inflight_key(node_class: str) -> str:
    return f"ace:inflight:{node_class}:single"


def cancel_key(request_id: str) -> str:
    return f"ace:prod:cancel:{request_id}"


# KEYS: workers, inflight. ARGV: request id, seconds the slot is held until a worker refreshes it.
# Returns {admitted (1), full (0) or no declared worker (-1), jobs in flight, capacity}.
ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local capacity = 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  capacity = capacity + (tonumber(string.match(member, '|(%d+)$')) or 0)
end
local busy = redis.call('ZCARD', KEYS[2])
if capacity == 0 then return {-1, busy, 0} end
if busy >= capacity then return {0, busy, capacity} end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
return {1, busy + 1, capacity}
"""

# KEYS: inflight, cancel, single-stream inflight. ARGV: request id, hold seconds. Pushes the slot's deadline
# forward in whichever count the gateway admitted it to (XX: only an existing member) and returns whether the job
# was cancelled.
STEP_LUA = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], 'XX', tonumber(t[1]) + tonumber(ARGV[2]), ARGV[1])
redis.call('ZADD', KEYS[3], 'XX', tonumber(t[1]) + tonumber(ARGV[2]), ARGV[1])
return redis.call('EXISTS', KEYS[2])
"""


# KEYS: the node class's prod/shadow queue (kombu's Redis list), inflight, single-stream inflight. Returns the jobs
# waiting on the queue plus the prod jobs admitted and still in flight (their deadline not passed).
FOREGROUND_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local running = redis.call('ZCOUNT', KEYS[2], now, '+inf') + redis.call('ZCOUNT', KEYS[3], now, '+inf')
return redis.call('LLEN', KEYS[1]) + running
"""


def foreground_jobs(client: redis.Redis, *, node_class: str, queue: str) -> int:
    """Prod and shadow jobs waiting on the node class's queue, and prod jobs running on it: a worker that batches
    takes a prod job off the queue at once and serves it in its batch loop's thread, so a queue that reads empty
    does not mean the node's cores are free (background work gives way to both, speculation.worker.tasks)."""
    keys = [queue, inflight_key(node_class), single_inflight_key(node_class)]
    return int(client.eval(FOREGROUND_LUA, len(keys), *keys) or 0)


class Cancelled(Exception):
    """The gateway asked this job to stop (its client went away, or it stopped waiting)."""


class JobSlot:
    """The worker's view of one prod job's slot: refresh + cancellation check per step, release at the end."""

    def __init__(self, client: redis.Redis, *, request_id: str, node_class: str, hold_s: float) -> None:
        self.client = client
        self.request_id = request_id
        self.keys = [inflight_key(node_class), cancel_key(request_id), single_inflight_key(node_class)]
        self.hold_s = hold_s
        self.step = client.register_script(STEP_LUA)

    def check(self, pipe: Any = None) -> None:
        """Refresh the slot and raise Cancelled when the gateway asked to stop (pipe: add to a pipeline instead,
        then call ``raise_if_cancelled`` with its last result)."""
        if pipe is not None:
            self.step(keys=self.keys, args=[self.request_id, self.hold_s], client=pipe)
            return
        self.raise_if_cancelled(self.step(keys=self.keys, args=[self.request_id, self.hold_s]))

    def raise_if_cancelled(self, result: Any) -> None:
        if int(result or 0):
            raise Cancelled(f"prod job {self.request_id} cancelled by the gateway")

    def release(self, pipe: Any = None) -> None:
        if pipe is not None:
            pipe.zrem(self.keys[0], self.request_id)
            pipe.zrem(self.keys[2], self.request_id)
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.zrem(self.keys[0], self.request_id)
            pipe.zrem(self.keys[2], self.request_id)
            pipe.execute()
        except redis.RedisError as exc:  # the slot expires by itself
            logger.warning("could not release the prod slot of %s: %s", self.request_id, exc)


class CapacityHeartbeat:
    """Declares this worker's prod capacity for each node class it consumes, until stopped: `concurrency` jobs at
    once, and, when it batches, `single` single-stream jobs (its processes) counted apart."""

    def __init__(
        self, *, redis_url: str, node_classes: list[str], member: str, concurrency: int, single: int = 0
    ) -> None:
        self.redis_url = redis_url
        self.node_classes = node_classes
        self.member = f"{member}|{concurrency}"
        self.single_member = f"{member}|{single}" if single > 0 else ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ace-capacity", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=2, socket_timeout=5)
        while not self._stop.is_set():
            try:
                now = float(client.time()[0])
                for node_class in self.node_classes:
                    client.zadd(workers_key(node_class), {self.member: now + WORKER_TTL_S})
                    if self.single_member:
                        client.zadd(single_workers_key(node_class), {self.single_member: now + WORKER_TTL_S})
            except redis.RedisError as exc:
                logger.warning("capacity heartbeat: %s", exc)
            self._stop.wait(HEARTBEAT_S)
        try:
            for node_class in self.node_classes:
                client.zrem(workers_key(node_class), self.member)
                if self.single_member:
                    client.zrem(single_workers_key(node_class), self.single_member)
        except redis.RedisError:
            pass
        client.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
