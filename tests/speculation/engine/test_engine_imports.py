"""speculation.engine is pure PyTorch: importing it pulls in no web, queue, settings or transformers code."""

from __future__ import annotations

import json
import subprocess
import sys

from ace import processes

FORBIDDEN = ("django", "celery", "rest_framework", "ace", "fleet", "transformers")


def test_engine_imports_nothing_from_django_celery_ace_fleet_or_transformers():
    code = (
        "import json, sys; import speculation.engine; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=processes.REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(processes.REPO_ROOT)},
    )
    top_level = set(json.loads(out.stdout))
    assert "torch" in top_level
    assert not top_level.intersection(FORBIDDEN), top_level.intersection(FORBIDDEN)
