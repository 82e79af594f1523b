"""The web process (pages, REST, gateway) never imports torch: loading the URL conf and the ASGI app stays light.

torch costs about 1.25 s and hundreds of MB per web process; only the worker (speculation.worker.tasks' generation,
shadow replay, training) needs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ace import processes

HEAVY = ("torch", "transformers", "safetensors")

WEB_PROCESS = """
import json, sys
import django
django.setup()
from django.urls import get_resolver
import ace.asgi
resolver = get_resolver()
resolver.url_patterns  # imports every view module the URL conf names
# every view module a request could reach, including lazily resolved ones
for pattern in resolver.reverse_dict.keys():
    pass
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))
"""


def _modules_loaded(code: str) -> set[str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "ace.settings", "PYTHONPATH": str(processes.REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=processes.REPO_ROOT, capture_output=True, text=True, check=True, env=env
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_loading_the_web_process_imports_no_torch():
    # given / when: a web process loads settings, the ASGI app and every URL pattern
    loaded = _modules_loaded(WEB_PROCESS)
    # then: Django is there, torch and model loaders are not
    assert "django" in loaded
    assert not loaded.intersection(HEAVY), loaded.intersection(HEAVY)


def test_the_check_would_see_torch_if_a_view_imported_it():
    # given: the same probe, with a module that does import torch (the worker's generation service)
    loaded = _modules_loaded(
        WEB_PROCESS.replace("import ace.asgi", "import ace.asgi\nimport speculation.offline.eagle.train")
    )
    # then: the probe reports it (so the first test can fail)
    assert "torch" in loaded
