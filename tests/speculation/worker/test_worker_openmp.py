"""The GPU worker loads torch with OMP_WAIT_POLICY=PASSIVE (ACE_WORKER_OMP_PASSIVE, default on): its idle OpenMP
threads sleep instead of spinning on cores a model server on the same node needs. The variable is set only while
torch loads (OpenMP reads it then) and removed again, so servers the worker starts keep their own default. Checked in
a fresh interpreter, the only place torch is not loaded yet: an import hook records the variable as torch is found."""

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
            seen["torch"] = os.environ.get("OMP_WAIT_POLICY", "unset")
        return None
sys.meta_path.insert(0, Spy())
from speculation.worker.tasks import _preload
_preload()
print("RESULT", seen.get("torch", "not-imported"), os.environ.get("OMP_WAIT_POLICY", "unset"))
"""


def _probe(**env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
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
        ({}, "PASSIVE", "unset"),  # the default: passive while torch loads, then removed
        ({"ACE_WORKER_OMP_PASSIVE": "false"}, "unset", "unset"),  # turned off: nothing set
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE", "ACTIVE"),  # an operator's own choice is kept
    ],
)
def test_the_worker_loads_torch_with_passive_openmp_threads_only(env, torch_saw, after):
    assert _probe(**env) == [torch_saw, after]
