"""Fire-and-forget work of an async process after a response (enqueueing a measurement, writing records): never
awaited by the request. Kept referenced until done, and a failure is logged with what it was."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)

_pending: set[asyncio.Task] = set()


def spawn(coro: Coroutine[Any, Any, Any], *, what: str) -> asyncio.Task:
    task = asyncio.get_running_loop().create_task(coro)
    _pending.add(task)

    def _done(t: asyncio.Task) -> None:
        _pending.discard(t)
        if not t.cancelled() and t.exception() is not None:
            logger.error("background %s failed: %r", what, t.exception())

    task.add_done_callback(_done)
    return task
