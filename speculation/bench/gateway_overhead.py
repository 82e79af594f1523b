"""python -m speculation.bench.gateway_overhead [--n N] [--json PATH] [--profile PATH] [--floor]

The gateway's own cost per off-mode request, against a model server that answers at once
(speculation.bench.fake_upstream), so that no model's noise hides it. Everything runs on a throw-away SQLite
database and Redis, started here and stopped at the end.

1. End to end: n sequential non-streaming completions, straight to the fake server and through ACE under
   uvicorn (started as the run command starts it), interleaved so drifts hit both; p50 / p99 of each.
2. --profile PATH: the same requests through `ace.asgi.application` in this process, with the wall time of
   each gateway stage (token check, route lookup, the upstream call, the rest: ASGI and Django handling), and
   a cProfile listing of the top functions by internal time written to PATH.
3. --floor: a third target in the same interleaving, a bare uvicorn relay (speculation.bench.relay_floor): what
   one more Python process on the path costs by itself on this machine, whatever the gateway does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from ace import processes

SETUP = """
import json, os
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from fleet.models import Endpoint
user = User.objects.create_superuser(username="bench", email="", password=None)
Endpoint.objects.create(
    name="fake", base_url=os.environ["ACE_BENCH_UPSTREAM"], kind="vllm", status="ready",
    served_model="fake-target", capabilities={"max_context": 2048}, owner=user,
)
print("SETUP" + json.dumps({"token": Token.objects.create(user=user).key}))
"""
BODY = {"model": "fake", "prompt": "def f():", "max_tokens": 1, "temperature": 0}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(direct: list[float], ace: list[float]) -> dict:
    ms = {name: [v * 1000 for v in values] for name, values in (("direct", direct), ("ace", ace))}
    out = {f"{name}_ms_{tag}": round(quantile(values, q), 3) for name, values in ms.items() for tag, q in _QS}
    for tag, q in _QS:
        out[f"overhead_ms_{tag}"] = round(quantile(ms["ace"], q) - quantile(ms["direct"], q), 3)
    out["requests"] = len(ace)
    return out


_QS = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


async def paired(
    direct_url: str, ace_url: str, *, n: int, token: str, floor_url: str = ""
) -> tuple[list[float], list[float], list[float]]:
    headers = {"Authorization": f"Bearer {token}"}
    direct_body = {**BODY, "model": "fake-target"}
    direct, ace, floor = [], [], []
    async with httpx.AsyncClient(timeout=30) as client:

        async def timed(url: str, body: dict, hdrs: dict) -> float:
            started = time.perf_counter()
            response = await client.post(url + "/v1/completions", json=body, headers=hdrs)
            response.raise_for_status()
            return time.perf_counter() - started

        for _ in range(5):  # warm connections, caches and the route table
            await timed(direct_url, direct_body, {})
            await timed(ace_url, BODY, headers)
            if floor_url:
                await timed(floor_url, direct_body, {})
        for _ in range(n):
            direct.append(await timed(direct_url, direct_body, {}))
            ace.append(await timed(ace_url, BODY, headers))
            if floor_url:
                floor.append(await timed(floor_url, direct_body, {}))
    return direct, ace, floor


class Stack:
    """Redis, the fake model server, a migrated SQLite database with one endpoint and a token."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ace-overhead-"))
        self._stack = ExitStack()
        self.env: dict[str, str] = {}
        self.upstream_url = ""
        self.token = ""

    def start(self) -> Stack:
        redis = processes.start_redis(workdir=self.dir / "redis", log_dir=self.dir)
        self._stack.callback(redis.stop)
        port = processes.free_port()
        fake = processes.spawn(
            "fake-upstream",
            [sys.executable, "-m", "speculation.bench.fake_upstream", str(port)],
            log_path=self.dir / "fake-upstream.log",
        )
        self._stack.callback(fake.stop)
        self.upstream_url = f"http://127.0.0.1:{port}"
        processes.wait_until(fake, lambda: processes.http_ok(self.upstream_url + "/v1/models"), timeout_s=20, what="up")
        self.env = {
            "DATABASE_URL": f"sqlite:///{self.dir / 'overhead.sqlite3'}",
            "REDIS_URL": redis.url,
            "DJANGO_SETTINGS_MODULE": "ace.settings",
            "ACE_LOG_LEVEL": "WARNING",
        }
        processes.run_manage("migrate", "-v", "0", env=self.env)
        out = processes.run_manage("shell", "-c", SETUP, env={**self.env, "ACE_BENCH_UPSTREAM": self.upstream_url})
        self.token = json.loads(out.split("SETUP", 1)[1])["token"]
        return self

    def start_ace(self) -> processes.ManagedProcess:
        ace = processes.start_asgi(name="ace-overhead", log_dir=self.dir, env=self.env)
        self._stack.callback(ace.stop)
        return ace

    def start_floor(self) -> str:
        """uvicorn with speculation.bench.relay_floor: one more Python process and nothing else."""
        port = processes.free_port()
        argv = [sys.executable, "-m", "uvicorn", "speculation.bench.relay_floor:app", "--port", str(port)]
        argv += ["--log-level", "warning", "--no-access-log"]
        env = {"ACE_RELAY_UPSTREAM": self.upstream_url}
        proc = processes.spawn("relay-floor", argv, log_path=self.dir / "relay-floor.log", env=env)
        self._stack.callback(proc.stop)
        processes.wait_until(proc, lambda: processes._tcp_open("127.0.0.1", port), timeout_s=30, what="listening")
        proc.url = f"http://127.0.0.1:{port}"
        return proc

    def stop(self) -> None:
        self._stack.close()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc): unlike wall time, not inflated by load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def end_to_end(stack: Stack, n: int, *, floor: bool) -> dict:
    relay = stack.start_floor() if floor else None
    ace = stack.start_ace()
    procs = {"ace": ace, **({"floor": relay} if relay else {})}
    before = {name: cpu_s(proc.pid) for name, proc in procs.items()}
    direct, ace_times, relayed = asyncio.run(
        paired(stack.upstream_url, ace.url, n=n, token=stack.token, floor_url=relay.url if relay else "")
    )
    out = summary(direct, ace_times)
    for name, proc in procs.items():  # warm-up requests included: 5 more than n
        out[f"{name}_cpu_ms_per_request"] = round((cpu_s(proc.pid) - before[name]) * 1000 / (n + 5), 3)
    if relayed:
        ms = [v * 1000 for v in relayed]
        for tag, q in _QS:
            out[f"floor_ms_{tag}"] = round(quantile(ms, q), 3)
            out[f"floor_overhead_ms_{tag}"] = round(quantile(ms, q) - out[f"direct_ms_{tag}"], 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--n", type=int, default=300, help="requests each way (default 300)")
    parser.add_argument("--json", dest="json_path", help="write the results there as JSON")
    parser.add_argument("--profile", help="also profile in process; the cProfile listing goes to this file")
    parser.add_argument(
        "--floor", action="store_true", help="also time a bare uvicorn relay (speculation.bench.relay_floor)"
    )
    args = parser.parse_args()
    stack = Stack().start()
    try:
        results = {"end_to_end": end_to_end(stack, args.n, floor=args.floor)}
        if args.profile:
            from speculation.bench import gateway_profile

            os.environ.update(stack.env)
            results["stages"] = gateway_profile.run(
                upstream_url=stack.upstream_url, token=stack.token, n=args.n, listing=Path(args.profile)
            )
    finally:
        stack.stop()
    results["meta"] = {"n": args.n, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load": os.getloadavg()}
    text = json.dumps(results, indent=2)
    print(text)
    if args.json_path:
        Path(args.json_path).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
