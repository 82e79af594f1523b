"""speculation.engine is pure PyTorch: importing it pulls in no web, queue, settings or transformers code."""

from __future__ import annotations

import json
import subprocess
import sys

from ace import processes

FORBIDDEN = ("django", "celery", "rest_framework", "ace", "fleet", "transformers")
# the stage's modules the engine may use: standard library only, so the facts they hold are written once
STAGE_MODULES_ALLOWED = {"speculation", "speculation.engine", "speculation.limits"}


def test_engine_imports_nothing_from_django_celery_ace_fleet_or_transformers():
    # every module of the package (its names are exported lazily, so importing the package alone loads little)
    code = (
        "import importlib, json, pkgutil, sys; import speculation.engine as e; "
        "[importlib.import_module(f'speculation.engine.{m.name}') for m in pkgutil.iter_modules(e.__path__)]; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=processes.REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(processes.REPO_ROOT)},
    )
    modules = set(json.loads(out.stdout))
    top_level = {m.split(".")[0] for m in modules}
    assert "torch" in top_level
    assert not top_level.intersection(FORBIDDEN), top_level.intersection(FORBIDDEN)
    stage = {m for m in modules if m.startswith("speculation") and not m.startswith("speculation.engine.")}
    assert stage <= STAGE_MODULES_ALLOWED, stage - STAGE_MODULES_ALLOWED
