"""ACE served by uvicorn on the test database, and endpoints registered with a real probe."""

from __future__ import annotations

import os
from pathlib import Path

from ace import processes


def database_url() -> str:
    from django.db import connection

    params = connection.settings_dict
    if params["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{params['NAME']}"
    auth = params["USER"] + (f":{params['PASSWORD']}" if params.get("PASSWORD") else "")
    return f"postgresql://{auth}@{params['HOST']}:{params['PORT'] or 5432}/{params['NAME']}"


def start_ace(
    *, redis_url: str, log_dir: Path, name: str = "ace-uvicorn", extra_env: dict[str, str] | None = None
) -> processes.ManagedProcess:
    """ACE itself under uvicorn (ASGI), on the session's test database."""
    env = {
        **(extra_env or {}),
        **os.environ,
        "DATABASE_URL": database_url(),
        "REDIS_URL": redis_url,
        "DJANGO_SETTINGS_MODULE": "ace.settings",
        "ACE_CELERY_EAGER": "false",
    }
    return processes.start_asgi(name=name, log_dir=log_dir, env=env, timeout_s=30)


# --- registering endpoints the way the product does ---------------------------------------------------------------

_probed: dict[str, tuple[str, str, dict]] = {}


def register_probed_endpoint(*, name: str, base_url: str, node_class: str = "cpu"):
    """An endpoint with what a real probe of base_url found (the probe runs once per server per session)."""
    from fleet.models import Endpoint, Probe
    from fleet.probing import run_probe
    from speculation.services.version import bump_routing_version

    endpoint = Endpoint.objects.create(name=name, base_url=base_url, node_class=node_class)
    if base_url not in _probed:
        probe = run_probe(Probe.objects.create(endpoint=endpoint).pk)
        endpoint.refresh_from_db()
        assert endpoint.status == "ready", probe.reason
        _probed[base_url] = (endpoint.status, endpoint.served_model, endpoint.capabilities)
    status, served_model, capabilities = _probed[base_url]
    Endpoint.objects.filter(pk=endpoint.pk).update(status=status, served_model=served_model, capabilities=capabilities)
    endpoint.refresh_from_db()
    bump_routing_version()
    return endpoint
