"""What the fuzz run talks to: ACE under uvicorn (ace.processes.start_asgi) on a throw-away SQLite database,
a real Redis, and a real model server (vLLM serving the demo target, or one given by URL), with one endpoint
per mode (off, shadow, prod) on that server and an admin API token. No worker: shadow measurements stay
queued and prod falls back to plain generation after ACE_PROD_START_TIMEOUT (kept short here)."""

from __future__ import annotations

import json
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from ace import processes

MODES = ("off", "shadow", "prod")
PROD_START_TIMEOUT_S = "0.5"

SETUP = """
import json, os
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from fleet.models import Endpoint, Probe
from fleet.probing import run_probe
from speculation.models import SpeculationPolicy
spec = json.loads(os.environ["ACE_FUZZ_SPEC"])
user = User.objects.create_superuser(username="fuzz", email="", password=None)
out = {"token": Token.objects.create(user=user).key, "endpoints": {}}
for mode in spec["modes"]:
    endpoint = Endpoint.objects.create(name=f"fuzz-{mode}", base_url=spec["upstream"], node_class="cpu")
    probe = run_probe(Probe.objects.create(endpoint=endpoint).pk)
    # Rows written directly: the fuzz exercises requests, not the policy service's checks.
    SpeculationPolicy.objects.update_or_create(
        endpoint=endpoint, defaults={"mode": mode, "mechanism": "ngram", "k": 3, "shadow_sample_rate": 1.0}
    )
    endpoint.refresh_from_db()
    out["endpoints"][mode] = {"name": endpoint.name, "id": endpoint.pk, "probe": probe.outcome, "reason": probe.reason,
                              "served_model": endpoint.served_model}
print("SETUP" + json.dumps(out))
"""


@dataclass
class FuzzStack:
    upstream: str = ""  # a running OpenAI-compatible server; empty: start vLLM with the demo target
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ace-fuzz-")))
    env: dict[str, str] = field(default_factory=dict)
    token: str = ""
    ace_url: str = ""
    endpoints: dict[str, dict] = field(default_factory=dict)
    ace: processes.ManagedProcess | None = None
    _stack: ExitStack = field(default_factory=ExitStack)

    def __enter__(self) -> FuzzStack:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _manage(self, *args: str, extra_env: dict[str, str] | None = None) -> str:
        return processes.run_manage(*args, env={**self.env, **(extra_env or {})})

    def start(self) -> FuzzStack:
        redis_proc = processes.start_redis(workdir=self.log_dir / "redis", log_dir=self.log_dir)
        self._stack.callback(redis_proc.stop)
        if not self.upstream:
            from ace.launcher import DEMO_MODEL_NAME
            from speculation.offline.demo import ensure_demo_pair

            vllm = processes.start_vllm(
                model_dir=ensure_demo_pair().target_dir, served_model_name=DEMO_MODEL_NAME, log_dir=self.log_dir
            )
            self._stack.callback(vllm.stop)
            self.upstream = vllm.url
        self.env = {
            "DATABASE_URL": f"sqlite:///{self.log_dir / 'fuzz.sqlite3'}",
            "REDIS_URL": redis_proc.url,
            "DJANGO_SETTINGS_MODULE": "ace.settings",
            "ACE_CELERY_EAGER": "false",
            "ACE_PROD_START_TIMEOUT": PROD_START_TIMEOUT_S,
            "ACE_LOG_LEVEL": "WARNING",
        }
        self._manage("migrate", "-v", "0")
        spec = json.dumps({"upstream": self.upstream, "modes": list(MODES)})
        out = self._manage("shell", "-c", SETUP, extra_env={"ACE_FUZZ_SPEC": spec})
        setup = json.loads(out.split("SETUP", 1)[1])
        self.token = setup["token"]
        self.endpoints = setup["endpoints"]
        self.ace = processes.start_asgi(name="ace-fuzz", log_dir=self.log_dir, env=self.env)
        self._stack.callback(self.ace.stop)
        self.ace_url = self.ace.url
        return self

    def stop(self) -> None:
        self._stack.close()

    def log_text(self) -> str:
        return self.ace.log_path.read_text(errors="replace") if self.ace is not None else ""
