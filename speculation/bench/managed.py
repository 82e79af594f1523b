"""bench_gateway --managed: off vs prod (native n-gram, native draft model) on one managed endpoint.

Everything is started for the run and stopped after it: a throw-away SQLite database, Redis, a Celery worker
consuming gpu.<NODE_CLASS> (so its managed-server supervisor runs vLLM for the endpoint) and ACE under
uvicorn. The endpoint is registered through the REST API as a user would; each mode change is a PATCH of its
policy, i.e. a blue/green switch done by the supervisor. Every figure is measured through ACE's gateway:

- per mode (off; prod n-gram K; prod demo draft model K) and concurrency (1, 8, 32 streams): aggregate tok/s
  (all tokens / wall time) and p50/p99 of the request latency; the multiplier is prod's aggregate tok/s over
  off's at the same concurrency; how many of prod's greedy outputs equal off's (same prompt, same concurrency);
- per switch: `switch_s`, from the policy change to the policy applied (the new instance probed and routed),
  and the requests that failed (error, non-200, a stream without its end) among those a background load of
  mixed greedy / temperature 0.7 streams sent during the switch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ace import processes
from speculation.bench.load import quantile, run_concurrent

logger = logging.getLogger(__name__)

NODE_CLASS = "managedbench"
NAME = "demo-managed"
SERVED = "demo-managed-model"
K = 3
CONCURRENCY = (1, 8, 32)
SWITCH_LOAD_STREAMS = 4
START_TIMEOUT_S = 900

SETUP = """
import json, os
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from speculation.services.drafts import register_draft
spec = json.loads(os.environ["ACE_BENCH_SPEC"])
user = User.objects.create_superuser(username="bench", email="", password=None)
register_draft(name="demo-draft", kind="draft_model", path=spec["draft_dir"])
print("SETUP" + json.dumps({"token": Token.objects.create(user=user).key}))
"""


@dataclass
class ManagedStack:
    target_dir: Path
    draft_dir: Path
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ace-bench-managed-")))
    env: dict[str, str] = field(default_factory=dict)
    token: str = ""
    ace_url: str = ""
    endpoint_id: int = 0
    _stack: ExitStack = field(default_factory=ExitStack)

    def start(self) -> ManagedStack:
        redis_proc = processes.start_redis(workdir=self.log_dir / "redis", log_dir=self.log_dir)
        self._stack.callback(redis_proc.stop)
        self.env = {
            "DATABASE_URL": f"sqlite:///{self.log_dir / 'bench.sqlite3'}",
            "REDIS_URL": redis_proc.url,
            "DJANGO_SETTINGS_MODULE": "ace.settings",
            "ACE_CELERY_EAGER": "false",
            "ACE_LOG_LEVEL": "WARNING",
            "ACE_MANAGED_SUPERVISOR": "true",
            "ACE_MANAGED_START_TIMEOUT": str(START_TIMEOUT_S),
            # The switch canary refuses vLLM 0.32's native speculation (wrong greedy outputs in mixed batches,
            # fleet.managed.canary); this bench measures its speed (its greedy outputs are compared with off's).
            "ACE_MANAGED_CANARY": "false",
            "ACE_DATA_DIR": str(self.log_dir / "data"),
        }
        self._manage("migrate", "-v", "0")
        spec = json.dumps({"draft_dir": str(self.draft_dir)})
        out = self._manage("shell", "-c", SETUP, extra_env={"ACE_BENCH_SPEC": spec})
        self.token = json.loads(out.split("SETUP", 1)[1])["token"]
        worker = processes.start_celery_worker(env=self.env, log_dir=self.log_dir, queues=f"control,gpu.{NODE_CLASS}")
        self._stack.callback(worker.stop, grace_s=60)
        ace = processes.start_asgi(name="ace-bench-managed", log_dir=self.log_dir, env=self.env)
        self._stack.callback(ace.stop)
        self.ace_url = ace.url
        created = self.api(
            "POST",
            "/api/v1/managed-endpoints/",
            {
                "name": NAME,
                "model_dir": str(self.target_dir),
                "served_name": SERVED,
                "node_class": NODE_CLASS,
                "server_args": {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True},
            },
        )
        self.endpoint_id = created["id"]
        return self

    def stop(self) -> None:
        self._stack.close()

    def _manage(self, *args: str, extra_env: dict[str, str] | None = None) -> str:
        return processes.run_manage(*args, env={**self.env, **(extra_env or {})})

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def api(self, method: str, path: str, body: dict | None = None) -> dict:
        auth = {"Authorization": f"Token {self.token}"}
        response = httpx.request(method, self.ace_url + path, json=body, headers=auth, timeout=60)
        if response.status_code >= 300:
            raise RuntimeError(f"{method} {path} answered {response.status_code}: {response.text[:2000]}")
        return response.json()

    def state(self) -> dict:
        return self.api("GET", f"/api/v1/endpoints/{self.endpoint_id}/managed/")


def wait(what: str, check: Callable[[], object], timeout_s: float = START_TIMEOUT_S) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class SwitchLoad:
    """Streams mixed greedy / temperature 0.7 completions in a loop during a switch; counts what failed."""

    def __init__(self, url: str, headers: dict[str, str], streams: int = SWITCH_LOAD_STREAMS) -> None:
        self.url, self.headers = url + "/v1/completions", headers
        self.stop = threading.Event()
        self.sent = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(streams)]

    def __enter__(self) -> SwitchLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=600)

    def _loop(self, index: int) -> None:
        body = {
            "model": NAME,
            "prompt": "def fibonacci(n):\n",
            "max_tokens": 16,
            "temperature": 0.0 if index % 2 == 0 else 0.7,
            "stream": True,
        }
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                self.sent += 1
                try:
                    with client.stream("POST", self.url, json=body, headers=self.headers) as response:
                        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
                    if response.status_code != 200:
                        self.failures.append(f"HTTP {response.status_code}")
                    elif not lines or lines[-1] != "data: [DONE]" or any('"error"' in line for line in lines):
                        self.failures.append("stream ended without [DONE] or with an error event")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")


def switch(stack: ManagedStack, **fields) -> dict:
    """PATCH the policy under load; wait until the switch is applied; {switch_s, requests, failed_requests}."""
    with SwitchLoad(stack.ace_url, stack.headers) as load:
        time.sleep(5)  # the load runs before the change
        started = time.perf_counter()
        stack.api("PATCH", f"/api/v1/endpoints/{stack.endpoint_id}/policy/", fields)

        def done() -> dict | None:
            latest = (stack.state().get("switches") or [{}])[0]
            return latest if latest.get("status") in ("done", "failed") else None

        latest = wait(f"the switch to {fields}", done)
        switch_s = time.perf_counter() - started
        time.sleep(5)  # and after it, on the new instance
    if latest["status"] != "done":
        raise RuntimeError(f"switch to {fields} failed: {latest.get('reason')}")
    return {
        "to": fields,
        "switch_s": round(switch_s, 1),
        "supervisor_duration_s": latest.get("duration_s"),
        "requests": load.sent,
        "failed_requests": len(load.failures),
        "failures": load.failures[:5],
    }


def measure(stack: ManagedStack, plan: dict, prompts: list[str]) -> dict[str, dict]:
    """{concurrency: {tok_s, p50_ms, p99_ms, requests}} through ACE's gateway, greedy streams."""
    out: dict[str, dict] = {}
    for concurrency in CONCURRENCY:
        count = plan["requests"][concurrency]
        batch = [prompts[i % len(prompts)] for i in range(count)]
        wall, results = asyncio.run(
            run_concurrent(
                stack.ace_url,
                model=NAME,
                prompts=batch,
                max_tokens=plan["max_tokens"],
                concurrency=concurrency,
                headers=stack.headers,
            )
        )
        latencies = [r.latency_s for r in results]
        out[str(concurrency)] = {
            "tok_s": round(sum(r.tokens for r in results) / wall, 3),
            "p50_ms": round(quantile(latencies, 0.5) * 1000, 1),
            "p99_ms": round(quantile(latencies, 0.99) * 1000, 1),
            "requests": count,
            "token_ids": [r.token_ids for r in results],  # greedy: compared with off's (shape drops them)
        }
        figures = {k: v for k, v in out[str(concurrency)].items() if k != "token_ids"}
        logger.info("managed bench: %s streams: %s", concurrency, figures)
    return out


def run(*, target_dir: Path, draft_dir: Path, prompts: list[str], plan: dict, log: Callable[[str], None]) -> dict:
    stack = ManagedStack(target_dir=target_dir, draft_dir=draft_dir)
    log(f"starting redis, worker (managed supervisor), ACE; the supervisor starts vLLM (logs {stack.log_dir})")
    try:
        stack.start()
        started = time.perf_counter()
        wait(
            "the first managed instance and its baseline", lambda: (stack.state().get("baseline") or {}).get("buckets")
        )
        first_start_s = time.perf_counter() - started
        log(f"managed endpoint serving after {first_start_s:.0f} s; measuring off")
        modes = {"off": measure(stack, plan, prompts)}
        switches = []
        for label, fields in (
            ("ngram", {"mode": "prod", "mechanism": "ngram", "k": K}),
            ("draft_model", {"mode": "prod", "mechanism": "draft_model", "draft": "demo-draft", "k": K}),
        ):
            switches.append(switch(stack, **fields))
            log(f"switch to {label}: {switches[-1]['switch_s']} s, {switches[-1]['failed_requests']} failed")
            modes[label] = measure(stack, plan, prompts)
        if plan["switch_back"]:
            switches.append(switch(stack, mode="off"))
            log(f"switch to off: {switches[-1]['switch_s']} s, {switches[-1]['failed_requests']} failed")
        baseline = stack.state().get("baseline")
    finally:
        stack.stop()
    return shape(modes, switches, first_start_s=first_start_s, baseline=baseline)


def _row(off: dict, prod: dict) -> dict:
    return {
        "off_tok_s": off["tok_s"],
        "prod_tok_s": prod["tok_s"],
        "multiplier": round(prod["tok_s"] / off["tok_s"], 4) if off["tok_s"] else None,
        "p50_ms": prod["p50_ms"],
        "p99_ms": prod["p99_ms"],
        "off_p50_ms": off["p50_ms"],
        "off_p99_ms": off["p99_ms"],
        # greedy requests whose tokens equal off's for the same prompt at the same concurrency
        "greedy_identical": f"{sum(a == b for a, b in zip(off['token_ids'], prod['token_ids'], strict=True))} of "
        f"{len(off['token_ids'])}",
    }


def shape(modes: dict[str, dict], switches: list[dict], **extra) -> dict:
    """The report's shape: "managed" is prod with the native draft model, "managed_ngram" with native n-gram."""
    off = modes["off"]
    return {
        "managed": {c: _row(off[c], modes["draft_model"][c]) for c in off},
        "managed_ngram": {c: _row(off[c], modes["ngram"][c]) for c in off},
        "switch_s": max(s["switch_s"] for s in switches),
        "failed_requests": sum(s["failed_requests"] for s in switches),
        "switches": switches,
        **extra,
    }
