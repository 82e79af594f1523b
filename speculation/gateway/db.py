"""The gateway's database reads (cache misses), in Django's sync thread, on a usable connection."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections, connection

T = TypeVar("T")


def _on_fresh_connection(fn: Callable[..., T], *args: object) -> T:
    if not connection.in_atomic_block:
        # The lean /v1 app sends no request signals, so nothing else closes a broken or expired connection here.
        close_old_connections()
    return fn(*args)


async def read(fn: Callable[..., T], *args: object) -> T:
    return await sync_to_async(_on_fresh_connection, thread_sensitive=True)(fn, *args)
