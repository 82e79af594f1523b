"""Everything bench_gateway needs, started for one run and stopped after: a throw-away SQLite database, Redis,
the real vLLM serving the demo target, a Celery worker on gpu.cpu, and ACE under uvicorn (ASGI)."""

from __future__ import annotations

import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ace import processes

SETUP = """
import json, os
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from fleet.models import Endpoint, Probe
from fleet.probing import run_probe
from speculation.services.drafts import register_draft
spec = json.loads(os.environ["ACE_BENCH_SPEC"])
user = User.objects.create_superuser(username="bench", email="", password=None)  # admin: sees every endpoint
out = {"token": Token.objects.create(user=user).key, "endpoints": {}}
for name, url in spec["endpoints"].items():
    endpoint = Endpoint.objects.create(name=name, base_url=url, node_class="cpu")
    probe = run_probe(Probe.objects.create(endpoint=endpoint).pk)
    out["endpoints"][name] = {"id": endpoint.pk, "status": probe.outcome, "reason": probe.reason}
register_draft(name="demo-draft", kind="draft_model", path=spec["draft_dir"])
if spec.get("eagle_dir"):
    register_draft(name="demo-eagle", kind="eagle_head", path=spec["eagle_dir"])
print("SETUP" + json.dumps(out))
"""


@dataclass
class BenchStack:
    target_dir: Path
    draft_dir: Path
    eagle_dir: Path | None = None  # registered as demo-eagle when given (the run command's demo head)
    with_native: bool = False
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ace-bench-")))
    env: dict[str, str] = field(default_factory=dict)
    token: str = ""
    ace_url: str = ""
    vllm_url: str = ""
    ngram_url: str = ""
    model: str = "ace-demo-target"
    endpoints: dict[str, dict] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)  # added to every ACE process's environment
    worker_concurrency: int = 1  # worker processes (prod slots) on gpu.cpu
    procs: dict[str, processes.ManagedProcess] = field(default_factory=dict)  # redis, vllm, worker, ace
    _stack: ExitStack = field(default_factory=ExitStack)

    def _manage(self, *args: str, extra_env: dict[str, str] | None = None) -> str:
        return processes.run_manage(*args, env={**self.env, **(extra_env or {})})

    def start(self) -> BenchStack:
        redis_proc = processes.start_redis(workdir=self.log_dir / "redis", log_dir=self.log_dir)
        self._stack.callback(redis_proc.stop)
        self.env = {
            "DATABASE_URL": f"sqlite:///{self.log_dir / 'bench.sqlite3'}",
            "REDIS_URL": redis_proc.url,
            "DJANGO_SETTINGS_MODULE": "ace.settings",
            "ACE_CELERY_EAGER": "false",
            "ACE_LOG_LEVEL": "WARNING",
            **self.extra_env,
        }
        # Both vLLM servers start at once (each takes tens of seconds to load). The pool's threads must outlive
        # the servers: a child started from a thread gets SIGTERM when that thread exits (PR_SET_PDEATHSIG).
        pool = ThreadPoolExecutor(max_workers=2)
        self._stack.callback(pool.shutdown, wait=False)
        plain = pool.submit(
            processes.start_vllm, model_dir=self.target_dir, served_model_name=self.model, log_dir=self.log_dir
        )
        ngram = (
            pool.submit(
                processes.start_vllm,
                model_dir=self.target_dir,
                served_model_name=self.model,
                log_dir=self.log_dir,
                speculative_config=processes.NGRAM_SPECULATIVE_CONFIG,
                dev_mode=True,
            )
            if self.with_native
            else None
        )
        vllm = plain.result()
        self._stack.callback(vllm.stop)
        if ngram is not None:
            native = ngram.result()
            self._stack.callback(native.stop)
            self.ngram_url = native.url
        self.vllm_url = vllm.url
        endpoints = {"demo": self.vllm_url}
        if self.ngram_url:
            endpoints["demo-ngram"] = self.ngram_url
        self._manage("migrate", "-v", "0")
        spec = json.dumps(
            {"endpoints": endpoints, "draft_dir": str(self.draft_dir), "eagle_dir": str(self.eagle_dir or "")}
        )
        out = self._manage("shell", "-c", SETUP, extra_env={"ACE_BENCH_SPEC": spec})
        setup = json.loads(out.split("SETUP", 1)[1])
        self.token = setup["token"]
        self.endpoints = setup["endpoints"]
        worker = processes.start_celery_worker(
            env=self.env, log_dir=self.log_dir, queues="control,gpu.cpu", concurrency=self.worker_concurrency
        )
        self._stack.callback(worker.stop)
        ace = processes.start_asgi(name="ace-bench", log_dir=self.log_dir, env=self.env)
        self._stack.callback(ace.stop)
        self.ace_url = ace.url
        self.procs.update(redis=redis_proc, vllm=vllm, worker=worker, ace=ace)
        return self

    def stop(self) -> None:
        self._stack.close()

    def restart_worker(self, *, extra_env: dict[str, str]) -> processes.ManagedProcess:
        """Stop the Celery worker and start it again with extra_env added (e.g. ACE_PROD_PLAIN=true)."""
        self.procs["worker"].stop()
        worker = processes.start_celery_worker(
            env={**self.env, **extra_env},
            log_dir=self.log_dir,
            queues="control,gpu.cpu",
            concurrency=self.worker_concurrency,
        )
        return self.adopt("worker", worker)

    def restart_ace(self, *, extra_env: dict[str, str]) -> processes.ManagedProcess:
        """Stop ACE's web process and start it again with extra_env added (e.g. ACE_GOODPUT_GUARD=false)."""
        self.procs["ace"].stop()
        ace = processes.start_asgi(name="ace-bench", log_dir=self.log_dir, env={**self.env, **extra_env})
        self.ace_url = ace.url
        return self.adopt("ace", ace)

    def adopt(self, name: str, proc: processes.ManagedProcess) -> processes.ManagedProcess:
        """A process started again during a run (the fault run's restarts): stopped with the rest."""
        self.procs[name] = proc
        self._stack.callback(proc.stop)
        return proc

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def set_policy(self, endpoint: str, **fields) -> dict:
        pk = self.endpoints[endpoint]["id"]
        response = httpx.patch(
            f"{self.ace_url}/api/v1/endpoints/{pk}/policy/",
            json=fields,
            headers={"Authorization": f"Token {self.token}"},
            timeout=30,
        )
        if response.status_code != 200:
            raise RuntimeError(f"policy {fields} refused: {response.text}")
        return response.json()

    def set_demo_pairing(self, endpoint: str = "demo", *, k: int = 5, mechanism: str = "draft_model") -> dict:
        """Prod with a demo pairing, set in full (on the local path): a policy left at its defaults would run n-gram
        lookup. mechanism "eagle_head": the demo head's chain at dynamic K from K (the run command's pairing);
        "draft_model": the demo draft at K; "suffix" or "ngram": that lookup; "suffix_draft": suffix decoding with
        the demo draft where it finds little."""
        draft = {"draft_model": "demo-draft", "suffix_draft": "demo-draft", "eagle_head": "demo-eagle"}.get(mechanism)
        return self.set_policy(
            endpoint, mode="prod", mechanism=mechanism, draft=draft, k=k, path="local",
            dynamic_k=mechanism == "eagle_head", target_path=str(self.target_dir),
        )  # fmt: skip

    def records(self, endpoint: str, **filters) -> list[dict]:
        params = {"endpoint": self.endpoints[endpoint]["id"], "limit": 1000, **filters}
        response = httpx.get(
            f"{self.ace_url}/api/v1/stage-records/",
            params=params,
            headers={"Authorization": f"Token {self.token}"},
            timeout=30,
        )
        response.raise_for_status()
        return response.json()["results"]
