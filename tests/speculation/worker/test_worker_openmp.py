"""The GPU worker loads torch with GOMP_SPINCOUNT=10000 (ACE_WORKER_OMP_SPINCOUNT): its idle OpenMP threads spin
about 0.1 ms, then sleep, instead of spinning for milliseconds on cores a model server on the same node needs. The
variable is set only while torch loads (OpenMP reads it then) and removed again, so servers the worker starts keep
their own default. Checked in a fresh interpreter, the only place torch is not loaded yet: an import hook records
the variable as torch is found."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PROBE = """
import os, sys, django
django.setup()
seen = {}
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "torch" not in seen:
            seen["torch"] = os.environ.get("GOMP_SPINCOUNT", "unset")
        return None
sys.meta_path.insert(0, Spy())
from speculation.worker.tasks import _preload
_preload()
print("RESULT", seen.get("torch", "not-imported"), os.environ.get("GOMP_SPINCOUNT", "unset"))
"""


def _probe(**env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    base.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-2000:]
    return lines[-1].split()[1:]


@pytest.mark.parametrize(
    ("env", "torch_saw", "after"),
    [
        ({}, "10000", "unset"),  # the default: a short spin while torch loads, then removed
        ({"ACE_WORKER_OMP_SPINCOUNT": "0"}, "0", "unset"),  # sleep at once (as OMP_WAIT_POLICY=PASSIVE)
        ({"ACE_WORKER_OMP_SPINCOUNT": "-1"}, "unset", "unset"),  # turned off: nothing set
        ({"GOMP_SPINCOUNT": "500"}, "500", "500"),  # an operator's own choice is kept
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "unset", "unset"),  # ... and so is their wait policy
    ],
)
def test_the_worker_loads_torch_with_a_short_openmp_spin_only(env, torch_saw, after):
    assert _probe(**env) == [torch_saw, after]
