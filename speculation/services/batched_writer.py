"""Writes behind the request, in batches: the gateway's stage records and captured traffic share this mechanism.

A row is appended to a bounded per-process queue and the request goes on; a flusher task on the event loop writes
what has queued every `flush_interval_s`, or at once when `batch_rows` wait, one `write` call (one INSERT) per
batch. Under overload (`max_rows()` waiting) a row is dropped rather than anyone waiting: counted in `dropped` and
handed to `on_drop` (a metric, a log line). What is queued is written on shutdown (the ASGI lifespan's shutdown
awaits `aflush`; an atexit hook writes what is left) and whenever `flush` / `aflush` is called (tests, benches).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async

from ace import background

logger = logging.getLogger(__name__)

Row = dict[str, Any]


class BatchedWriter:
    """One kind of row's queue and flusher. `write(rows) -> rows written` is called from a thread, one batch at a
    time; a batch it raises on is logged as lost (a write behind the request never breaks the gateway)."""

    def __init__(
        self,
        *,
        what: str,
        write: Callable[[list[Row]], int],
        max_rows: Callable[[], int],
        batch_rows: int,
        flush_interval_s: float,
        on_drop: Callable[[Row], None] | None = None,
    ) -> None:
        self.what = what  # plural, for log lines: "stage records", "captures"
        self.write = write
        self.max_rows = max_rows  # read on every put, so a changed setting applies at once
        self.batch_rows = batch_rows
        self.flush_interval_s = flush_interval_s
        self.on_drop = on_drop
        self.queue: deque[Row] = deque()
        self.dropped = 0
        self._flusher: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        atexit.register(self._flush_at_exit)

    def put(self, row: Row) -> bool:
        """Queue a row from the event loop; never blocks. Returns False when a full queue dropped it."""
        if len(self.queue) >= self.max_rows():
            self.dropped += 1
            if self.on_drop is not None:
                self.on_drop(row)
            return False
        self.queue.append(row)
        loop = asyncio.get_running_loop()
        if self._flusher is None or self._flusher.done() or self._flusher.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._flusher = background.spawn(self._flush_loop(self._wake), what=self.what)
        elif len(self.queue) >= self.batch_rows and self._wake is not None:
            self._wake.set()
        return True

    async def _flush_loop(self, wake: asyncio.Event) -> None:
        while self.queue:
            if len(self.queue) < self.batch_rows:
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), self.flush_interval_s)
            batch = self._take()
            if batch:
                await sync_to_async(self._write_batch, thread_sensitive=True)(batch)

    def _take(self) -> list[Row]:
        batch: list[Row] = []
        with contextlib.suppress(IndexError):  # another thread's flush may empty the queue meanwhile
            while len(batch) < self.batch_rows:
                batch.append(self.queue.popleft())
        return batch

    def _write_batch(self, batch: list[Row]) -> int:
        try:
            return self.write(batch)
        except Exception:  # noqa: BLE001 - a write behind the request never breaks the gateway; the batch is logged
            logger.exception("%d %s not written", len(batch), self.what)
            return 0

    def flush(self) -> int:
        """Write every queued row now, from sync code; returns the rows written."""
        written = 0
        while batch := self._take():
            written += self._write_batch(batch)
        return written

    async def aflush(self) -> int:
        """Write every queued row now, from async code (the lifespan's shutdown, tests)."""
        return await sync_to_async(self.flush, thread_sensitive=True)()

    def queued(self) -> int:
        return len(self.queue)

    def _flush_at_exit(self) -> None:
        if self.queue:
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - at exit, a lost row is logged, never a traceback on shutdown
                logger.exception("%d %s not written at exit", len(self.queue), self.what)
