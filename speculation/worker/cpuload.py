"""How busy this node's cores are with other processes' work: a calibration of the worker's own costs waits until
they are quiet, as they are while prod's steps run.

Read from Linux's /proc/stat (every core's busy time) less this process's own time (os.times: all its threads,
the calibration's relay included), over a short window. Where /proc/stat cannot be read (not Linux), None: the
caller times without waiting.

Why: vLLM's CPU build busy-waits a core for about 1 s after its last request, after its running-requests gauge
already reads 0; a calibration started then times the demo pair's verify(5) at twice its quiet cost.
"""

from __future__ import annotations

import os
import time

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _busy_s() -> float | None:
    """Every core's busy seconds since boot (user, nice, system, irq, softirq, steal: not idle or iowait)."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        return None
    ticks = [int(x) for x in fields[1:9]]
    busy = sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
    return busy * _TICK_S


def _own_s() -> float:
    times = os.times()
    return times.user + times.system


def others_cores(window_s: float = 0.1) -> float | None:
    """Cores' worth of CPU the node's other processes used over the next window_s; None where unreadable."""
    busy, own, started = _busy_s(), _own_s(), time.monotonic()
    if busy is None:
        return None
    time.sleep(window_s)
    after = _busy_s()
    if after is None:
        return None
    wall = time.monotonic() - started
    return max(0.0, (after - busy) - (_own_s() - own)) / wall if wall > 0 else None


def wait_until_quiet(*, deadline: float, cores: float, window_s: float = 0.1) -> bool:
    """Wait until other processes use less than `cores` cores over a window, at most until the monotonic deadline;
    False when they stayed busy (or it cannot say)."""
    while True:
        used = others_cores(window_s)
        if used is None:
            return False
        if used < cores:
            return True
        if time.monotonic() > deadline:
            return False
