"""The GPU worker's OpenMP threads on a CPU: one team per process, in the batch loop's thread.

Why: with torch's CPU build (libgomp and MKL) each OS thread that calls torch gets its own OpenMP team, and two
teams on the same cores wait on each other; a linear layer of the demo target runs 3x slower in a second team, and
as slow with OMP_WAIT_POLICY=PASSIVE (every parallel region wakes sleeping threads). The batch's aggregate rate
halves with it (figures: `docs/BENCHMARKS.md`, "Worker threads").

So a process that batches on a CPU runs torch with up to ``ACE_WORKER_TORCH_THREADS`` threads (default: one per core;
per step ``threads_for``) in its batch loop's thread only; every other thread that calls torch (the
Celery task's: model loading, shadow replays, single-stream prod; the request threads) runs it with one thread, so
no second team forms. Idle threads of the team spin ``ACE_WORKER_OMP_SPINCOUNT`` iterations (GOMP_SPINCOUNT, about
0.1 ms at 10000) and then sleep, so between steps they leave the cores to a model server on the same node. OpenMP
reads the variable when torch loads (``load_torch``); it is removed again, so servers the worker starts keep their
own default.

On a GPU none of this applies (kernels do not wait on OpenMP teams): nothing is changed there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

_loop_threads = 0  # the batch loop's torch threads (0: not decided yet)
_lock = threading.Lock()


def load_torch(imports: Callable[[], Any]) -> None:
    """Run ``imports`` (which loads torch) with the worker's OpenMP settings in the environment, then fix this
    thread's torch threads: one where the batch loop is to hold the process's only team."""
    from django.conf import settings

    added = {}
    if "OMP_WAIT_POLICY" not in os.environ:
        if settings.WORKER_OMP_PASSIVE:
            added["OMP_WAIT_POLICY"] = "PASSIVE"
        elif settings.WORKER_OMP_SPINCOUNT >= 0 and "GOMP_SPINCOUNT" not in os.environ:
            added["GOMP_SPINCOUNT"] = str(settings.WORKER_OMP_SPINCOUNT)
    os.environ.update(added)
    try:
        imports()
    finally:
        for name in added:
            del os.environ[name]
    side_thread()


def one_team() -> bool:
    """Whether this process keeps one OpenMP team, in its batch loop: batching on, and no GPU."""
    from speculation.worker import batching

    if not batching.enabled():
        return False
    import torch

    return not torch.cuda.is_available()


WIDE_BATCH = 4  # a step of this many requests or more runs on every core the loop has


def loop_threads() -> int:
    """The batch loop's most torch threads: ACE_WORKER_TORCH_THREADS, else torch's default here (one per core)."""
    global _loop_threads
    from django.conf import settings

    with _lock:
        if not _loop_threads:
            import torch

            _loop_threads = settings.WORKER_TORCH_THREADS or torch.get_num_threads()
        return _loop_threads


def threads_for(batch_size: int) -> int:
    """The loop's torch threads for a step of this many requests: all of loop_threads() from WIDE_BATCH requests on,
    one fewer below (at least one), so that a core is left to what streams each step's tokens (the request threads,
    Redis, the web process) and to a model server on the node. On 2 cores one stream's request runs faster with
    one thread (each step's relay preempts one of two, and both wait at every parallel region's end), 8 streams
    faster with two (docs/BENCHMARKS.md, "Worker threads"). Switching the count between steps costs nothing
    measurable."""
    most = loop_threads()
    return most if batch_size >= WIDE_BATCH else max(1, most - 1)


def side_thread() -> None:
    """This thread (not the batch loop's) runs torch with one thread where the process keeps one team."""
    if one_team():
        loop_threads()  # torch's default, read before the first thread is set to one
        _set_threads(1)


class BatchLoopThreads:
    """The batch loop's thread holds the process's team, sized per step (threads_for). torch.set_num_threads is per
    thread for OpenMP and MKL, but new threads start from the last value set, so the request threads set theirs back
    to one (side_thread)."""

    def __init__(self) -> None:
        self.enabled = one_team()
        self.current = 0
        if self.enabled:
            loop_threads()
            self.size(1)

    def size(self, batch_size: int) -> None:
        """Threads for a step of batch_size requests (a calibration times one request: 1)."""
        if self.enabled:
            self._set(threads_for(batch_size))

    def prefill(self) -> None:
        """Every thread the loop has, for prefilling joining prompts: no request's tokens stream meanwhile, and the
        work is large (on the 2-core machine a 256-token prompt of the demo pair: 53-55 ms with two threads, 90-93
        with one; 64 tokens: 20-21 vs 28-29)."""
        if self.enabled:
            self._set(loop_threads())

    def _set(self, wanted: int) -> None:
        if wanted != self.current:
            _set_threads(wanted)
            self.current = wanted


def _set_threads(n: int) -> None:
    """This thread's torch threads. torch sets a thread's OpenMP and MKL count from the last value set by any
    thread when it first asks for it (lazily, at its first parallel region): asked first, so that it does not
    overwrite this thread's own count later."""
    import torch

    torch.get_num_threads()
    torch.set_num_threads(n)
