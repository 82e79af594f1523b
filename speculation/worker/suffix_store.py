"""Suffix decoding's store of earlier responses, per endpoint, shared by the worker processes through Redis.

Each worker process keeps one ``speculation.engine.suffix.SuffixIndex`` per endpoint (what its proposers look up)
and brings it up to date from Redis before a request drafts from it. What goes in: the output tokens of every
request of the endpoint the workers see (shadow's measured requests, prod's requests), under the request id, the
oldest dropped past settings.SUFFIX_CACHE_REQUESTS (as vLLM's ``suffix_decoding_max_cached_requests``).

Redis holds the list ``ace:suffix:{endpoint}`` of ``[serial, key, tokens]`` (JSON), trimmed to the cap, and the
counter ``ace:suffix:{endpoint}:n`` that numbers them; a process reads only the entries past the last serial it
took. With Redis down the process's own index still serves (and learns from what this process sees); nothing
fails. A replay of a request whose own answer is stored already (shadow stores it, then the candidate replays run)
excludes it by its key (``SuffixProposer(exclude=request_id)``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field

import redis
from django.conf import settings

from speculation.engine.suffix import SuffixIndex

logger = logging.getLogger(__name__)

LIST_KEY = "ace:suffix:{endpoint_id}"
COUNT_KEY = "ace:suffix:{endpoint_id}:n"
SYNC_S = 0.5  # a process reads Redis at most this often per endpoint
MAX_TOKENS = 4096  # a longer response is stored up to here
SLACK = 16  # entries read beyond the count's difference (writers racing between INCR and RPUSH)


@dataclass
class _Local:
    index: SuffixIndex
    seen: int = 0  # the highest serial taken from Redis
    synced_at: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


_locals: dict[int, _Local] = {}
_guard = threading.Lock()
_clients: dict[str, redis.Redis] = {}


def _redis() -> redis.Redis:
    url = settings.REDIS_URL
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
    return client


def _local(endpoint_id: int) -> _Local:
    with _guard:
        found = _locals.get(endpoint_id)
        if found is None:
            found = _locals[endpoint_id] = _Local(SuffixIndex(max_sequences=max(1, settings.SUFFIX_CACHE_REQUESTS)))
        return found


def enabled() -> bool:
    return settings.SUFFIX_CACHE_REQUESTS > 0


def index_for(endpoint_id: int) -> SuffixIndex:
    """The endpoint's index in this process, brought up to date from Redis (at most every SYNC_S). With the store
    off (ACE_SUFFIX_CACHE_REQUESTS=0) an empty index: suffix decoding then looks up the request's context only."""
    local = _local(endpoint_id)
    if not enabled():
        return local.index
    with local.lock:
        if time.monotonic() - local.synced_at >= SYNC_S:
            local.synced_at = time.monotonic()
            _sync(endpoint_id, local)
    return local.index


def _sync(endpoint_id: int, local: _Local) -> None:
    try:
        count = int(_redis().get(COUNT_KEY.format(endpoint_id=endpoint_id)) or 0)
        if count <= local.seen:
            return
        wanted = min(count - local.seen, settings.SUFFIX_CACHE_REQUESTS) + SLACK
        entries = _redis().lrange(LIST_KEY.format(endpoint_id=endpoint_id), -wanted, -1)
    except (redis.RedisError, OSError) as exc:
        logger.info("suffix store of endpoint %s not read from Redis: %s", endpoint_id, type(exc).__name__)
        return
    for entry in entries:
        try:
            serial, key, tokens = json.loads(entry)
        except (ValueError, TypeError):
            continue  # not ours: skip it
        if int(serial) > local.seen:
            local.index.add(str(key), tokens)
    local.seen = max(local.seen, count)


def remember(endpoint_id: int, key: str, output_ids: list[int]) -> None:
    """Store one response (this process's index at once, the other processes' through Redis). Never raises."""
    if not enabled() or len(output_ids) < 2:
        return
    tokens = [int(t) for t in output_ids[:MAX_TOKENS]]
    _local(endpoint_id).index.add(key, tokens)
    try:
        client = _redis()
        serial = client.incr(COUNT_KEY.format(endpoint_id=endpoint_id))
        list_key = LIST_KEY.format(endpoint_id=endpoint_id)
        with client.pipeline(transaction=False) as pipe:
            pipe.rpush(list_key, json.dumps([serial, key, tokens], separators=(",", ":")))
            pipe.ltrim(list_key, -settings.SUFFIX_CACHE_REQUESTS, -1)
            pipe.execute()
    except (redis.RedisError, OSError) as exc:
        logger.info("suffix store of endpoint %s: response %s kept in this process only: %s", endpoint_id, key,
                    type(exc).__name__)  # fmt: skip


def forget(endpoint_id: int | None = None, *, redis_too: bool = False) -> None:
    """Drop this process's index (all endpoints when None); redis_too: the endpoint's shared store as well."""
    with _guard:
        if endpoint_id is None:
            _locals.clear()
        else:
            _locals.pop(endpoint_id, None)
    if redis_too and endpoint_id is not None:
        try:
            _redis().delete(LIST_KEY.format(endpoint_id=endpoint_id), COUNT_KEY.format(endpoint_id=endpoint_id))
        except (redis.RedisError, OSError):
            pass
