"""Throttles on failed sign-ins and bad API tokens: after `limit` failures of one key (a username and client
address, or a client address) within `window_s` seconds, that key waits until its oldest failure leaves the window.

Kept in each web process's memory (no round trip to Redis on the gateway's path): with several web processes
(ACE_WEB_WORKERS) a client gets up to that many times `limit` tries per window. That still turns guessing a
password or a 40-character token from thousands of tries a minute into a handful.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from django.conf import settings

MAX_KEYS = 100_000  # beyond this many keys the oldest are forgotten: memory stays bounded under a flood


class FailureThrottle:
    def __init__(self, *, limit: Callable[[], int], window_s: Callable[[], int], clock=time.monotonic) -> None:
        self._limit, self._window_s, self._clock = limit, window_s, clock
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def wait_s(self, key: str) -> int:
        """Seconds `key` must wait before its next try (0: it may try now)."""
        limit = self._limit()
        if limit <= 0:
            return 0
        with self._lock:
            times = self._recent(key)
            if times is None or len(times) < limit:
                return 0
            return max(1, int(times[0] + self._window_s() - self._clock() + 0.999))

    def failed(self, key: str) -> None:
        if self._limit() <= 0:
            return
        with self._lock:
            times = self._recent(key)
            if times is None:
                if len(self._failures) >= MAX_KEYS:
                    del self._failures[next(iter(self._failures))]
                times = self._failures[key] = deque()
            times.append(self._clock())
            while len(times) > self._limit():
                times.popleft()

    def succeeded(self, key: str) -> None:
        with self._lock:
            self._failures.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._failures.clear()

    def _recent(self, key: str) -> deque[float] | None:
        times = self._failures.get(key)
        if times is None:
            return None
        horizon = self._clock() - self._window_s()
        while times and times[0] <= horizon:
            times.popleft()
        if not times:
            del self._failures[key]
            return None
        return times


logins = FailureThrottle(limit=lambda: settings.LOGIN_THROTTLE, window_s=lambda: settings.THROTTLE_WINDOW_S)
tokens = FailureThrottle(limit=lambda: settings.TOKEN_THROTTLE, window_s=lambda: settings.THROTTLE_WINDOW_S)


def login_key(username: str, client: str) -> str:
    return f"{username.strip().lower()[:150]}|{client}"


def wait_message(wait_s: int) -> str:
    return f"Too many failed attempts from this address; try again in {wait_s} s."
