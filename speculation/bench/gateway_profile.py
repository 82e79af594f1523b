"""Where an off-mode request's time goes inside the gateway (speculation.bench.gateway_overhead --profile).

Drives `ace.asgi.application` in this process, one request at a time, as an ASGI server would (no socket on
ACE's side), with timing wrappers around the gateway's stages; then runs the same requests under cProfile.
Django must be configurable from the environment (DATABASE_URL, REDIS_URL) before `run` is called.
"""

from __future__ import annotations

import asyncio
import cProfile
import importlib
import inspect
import io
import json
import pstats
import statistics
import time
from collections import defaultdict
from pathlib import Path

# (label, module, attribute): the stages timed, where the running code has them.
STAGES = (
    ("version read", "speculation.gateway.routes", "RouteCache.stamp"),
    ("token check", "speculation.gateway.views", "authenticate"),
    ("scope check", "speculation.gateway.auth", "Principal.may_call"),
    ("route lookup", "speculation.gateway.routes", "RouteCache.lookup"),
    ("upstream call", "speculation.gateway.passthrough", "forward"),
)
BODY = {"model": "fake", "prompt": "def f():", "max_tokens": 1, "temperature": 0}


def _timed(label: str, fn, spent: dict[str, float]):
    if not inspect.iscoroutinefunction(fn):

        def plain(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - started

        return plain

    async def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - started

    return wrapper


def _instrument(spent: dict[str, float]) -> list[str]:
    found = []
    for label, module_name, attr in STAGES:
        owner = importlib.import_module(module_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, name):
            continue
        setattr(owner, name, _timed(label, getattr(owner, name), spent))
        found.append(label)
    return found


def _scope(token: str, raw: bytes) -> dict:
    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(raw)).encode()),
        (b"authorization", f"Bearer {token}".encode()),
    ]
    path = "/v1/completions"
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


async def _one(app, scope: dict, raw: bytes) -> int:
    return (await exchange(app, scope, raw))[0]["status"]


async def exchange(app, scope: dict, raw: bytes) -> list[dict]:
    """One request through the ASGI app as a server would drive it; the messages the app sent (start, body...)."""
    sent: list[dict] = []
    finished = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    finished.set()
    return sent


async def _direct(upstream_url: str, n: int) -> list[float]:
    """The fake server's own round trip through the gateway's pooled client (subtracted from the upstream call)."""
    from speculation.gateway import upstream

    body = json.dumps({**BODY, "model": "fake-target"}).encode()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        response = await upstream.client().post(upstream_url + "/v1/completions", content=body)
        await response.aread()
        times.append(time.perf_counter() - started)
    return times


async def _drive(app, token: str, n: int, spent: dict[str, float], per_request: dict[str, list[float]]) -> None:
    raw = json.dumps(BODY).encode()
    scope = _scope(token, raw)
    for _ in range(5):
        assert await _one(app, dict(scope), raw) == 200
    for _ in range(n):
        spent.clear()
        started = time.perf_counter()
        status = await _one(app, dict(scope), raw)
        total = time.perf_counter() - started
        assert status == 200, status
        per_request["total"].append(total)
        for label, seconds in spent.items():
            per_request[label].append(seconds)
        per_request["rest (ASGI, Django, body, response)"].append(total - sum(spent.values()))
        # What the gateway itself spends: everything but the upstream call (whose own cost over the bare round
        # trip is the pooled client's: compare "upstream call" with "fake server round trip").
        per_request["gateway own (total minus upstream call)"].append(total - spent.get("upstream call", 0.0))


def run(*, upstream_url: str, token: str, n: int, listing: Path) -> dict:
    import django

    django.setup()
    from ace.asgi import application

    spent: dict[str, float] = defaultdict(float)
    stages = _instrument(spent)
    per_request: dict[str, list[float]] = defaultdict(list)

    async def timed() -> list[float]:
        await _drive(application, token, n, spent, per_request)
        return await _direct(upstream_url, n)

    direct = asyncio.run(timed())
    profiler = cProfile.Profile()
    profiler.enable()
    asyncio.run(_drive(application, token, min(n, 200), defaultdict(float), defaultdict(list)))
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    text.write("\n")
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
    listing.write_text(text.getvalue())

    def ms(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000, 3)

    out = {
        label: {
            "p50_ms": ms(values, 0.5),
            "p99_ms": ms(values, 0.99),
            "mean_ms": round(statistics.mean(values) * 1000, 3),
        }
        for label, values in per_request.items()
    }
    out["fake server round trip"] = {"p50_ms": ms(direct, 0.5), "p99_ms": ms(direct, 0.99)}
    out["stages_timed"] = sorted(set(stages))
    return out
