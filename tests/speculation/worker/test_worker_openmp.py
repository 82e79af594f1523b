"""The GPU worker's OpenMP threads (speculation.worker.openmp), checked in fresh interpreters (the only place torch
is not loaded yet, and a process's OpenMP teams are its own).

- Torch loads with GOMP_SPINCOUNT (ACE_WORKER_OMP_SPINCOUNT, default 10000: idle threads spin briefly, then sleep),
  or OMP_WAIT_POLICY=PASSIVE where ACE_WORKER_OMP_PASSIVE asks for it; the variable is set only while torch loads
  and removed again, so servers the worker starts keep their own default; an operator's own setting is kept.
- A process that batches on a CPU runs torch with one thread everywhere but in its batch loop's thread, which gets up
  to torch's default (or ACE_WORKER_TORCH_THREADS), one fewer for a step of few requests, also after other threads
  have run torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SETUP = """
import os, sys, django
django.setup()
seen = {}
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "torch" not in seen:
            seen["torch"] = [os.environ.get(v, "unset") for v in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")]
        return None
sys.meta_path.insert(0, Spy())
from speculation.worker.tasks import _preload
_preload()
"""
LOADING = (
    SETUP
    + """
after = [os.environ.get(v, "unset") for v in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")]
print("RESULT", *seen.get("torch", ["not-imported"] * 2), *after)
"""
)
THREADS = (
    SETUP
    + """
import threading, torch
from speculation.worker import batching
torch.ones(64, 64) @ torch.ones(64, 64)  # the task thread runs torch (model loading, shadow replays)
loop = batching.BatchLoop(slots=2, load_aware_k=False)
seen_loop = loop.call(lambda: torch.get_num_threads(), timeout_s=60)
request = []
batching.hand_off({"request_id": "r" * 16}, lambda job: request.append(torch.get_num_threads()))
for _ in range(200):
    if request:
        break
    threading.Event().wait(0.05)
again = loop.call(lambda: torch.get_num_threads(), timeout_s=60)
print("RESULT", torch.get_num_threads(), seen_loop, request[0], again)
loop.stop()
"""
)


def _probe(code: str, **env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    base.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-2000:]
    return lines[-1].split()[1:]


@pytest.mark.parametrize(
    ("env", "torch_saw", "after"),
    [
        ({}, ["unset", "10000"], ["unset", "unset"]),  # the default: a short spin while torch loads, then removed
        ({"ACE_WORKER_OMP_SPINCOUNT": "-1"}, ["unset", "unset"], ["unset", "unset"]),  # OpenMP's own default
        ({"ACE_WORKER_OMP_PASSIVE": "true"}, ["PASSIVE", "unset"], ["unset", "unset"]),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, ["ACTIVE", "unset"], ["ACTIVE", "unset"]),  # an operator's choice is kept
        ({"GOMP_SPINCOUNT": "5"}, ["unset", "5"], ["unset", "5"]),
    ],
)
def test_the_worker_loads_torch_with_its_openmp_setting_only_while_it_loads(env, torch_saw, after):
    assert _probe(LOADING, **env) == [*torch_saw, *after]


def test_a_batching_cpu_worker_keeps_its_threads_in_the_batch_loop():
    main, loop, request, loop_again = map(int, _probe(THREADS, ACE_BATCH_SLOTS="4", ACE_WORKER_TORCH_THREADS="3"))
    assert (main, loop, request, loop_again) == (1, 2, 1, 2)  # the loop at load 1: one thread fewer than 3


def test_a_worker_that_does_not_batch_keeps_torchs_threads():
    main, loop, request, loop_again = map(int, _probe(THREADS, ACE_BATCH_SLOTS="0", ACE_WORKER_TORCH_THREADS="2"))
    assert main == loop == request == loop_again >= 1
    assert main == int(_probe("import torch; print('RESULT', torch.get_num_threads())")[0])


def test_by_default_the_batch_loop_leaves_one_core_to_the_rest_below_a_wide_batch():
    default = int(_probe("import torch; print('RESULT', torch.get_num_threads())")[0])
    main, loop, request, loop_again = map(int, _probe(THREADS, ACE_BATCH_SLOTS="4", ACE_WORKER_TORCH_THREADS="0"))
    assert (main, request) == (1, 1)
    assert loop == loop_again == max(1, default - 1)  # a calibration (one request) runs as a step at load 1


def test_a_step_takes_every_core_from_a_wide_batch_on(settings, monkeypatch):
    from speculation.worker import openmp

    settings.WORKER_TORCH_THREADS = 4
    monkeypatch.setattr(openmp, "_loop_threads", 0)
    assert [openmp.threads_for(n) for n in (1, 2, 3, 4, 8)] == [3, 3, 3, 4, 4]
    settings.WORKER_TORCH_THREADS = 1
    monkeypatch.setattr(openmp, "_loop_threads", 0)
    assert [openmp.threads_for(n) for n in (1, 8)] == [1, 1]


def test_the_batch_loop_sizes_its_threads_per_step(monkeypatch):
    from speculation.worker import openmp

    monkeypatch.setattr(openmp, "one_team", lambda: True)
    monkeypatch.setattr(openmp, "_loop_threads", 2)
    set_to = []
    monkeypatch.setattr(openmp, "_set_threads", set_to.append)
    threads = openmp.BatchLoopThreads()
    for batch in (1, 1, 8, 5, 2):
        threads.size(batch)
    assert set_to == [1, 2, 1]  # at start (load 1), a wide batch, a narrow one again; no call when unchanged
    threads.prefill()
    threads.size(1)
    assert set_to == [1, 2, 1, 2, 1]  # a join's prefill takes every thread, the step after it one fewer
