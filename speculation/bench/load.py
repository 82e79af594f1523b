"""Load generation for bench_gateway: timed requests, direct to vLLM or through ACE, at a given concurrency."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

FALLBACK_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "Write a function that parses a CSV file.",
    "Explain what a hash map is.",
]


def load_prompts(path: Path | None, *, per_category: int, max_chars: int = 600) -> list[tuple[str, str]]:
    """(category, first turn) from Spec-Bench, `per_category` of each category; built-in prompts if absent."""
    if path is None or not path.is_file():
        return [("builtin", p) for p in FALLBACK_PROMPTS]
    seen: dict[str, int] = {}
    prompts = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        category = row["category"]
        if seen.get(category, 0) >= per_category:
            continue
        seen[category] = seen.get(category, 0) + 1
        prompts.append((category, row["turns"][0][:max_chars]))
    return prompts


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Result:
    latency_s: float
    tokens: int
    token_ids: list[int]


async def chat(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    model: str,
    prompt: str,
    max_tokens: int,
    headers: dict[str, str],
    stream: bool = False,
    sampling: dict | None = None,
) -> Result:
    """One chat request (greedy unless sampling names temperature / top_p / seed), timed to its last token."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **(sampling or {}),
    }
    started = time.perf_counter()
    if not stream:
        response = await client.post(base_url + "/v1/chat/completions", json=body, headers=headers)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        ids = choice.get("token_ids") or []
        return Result(time.perf_counter() - started, len(ids), ids)
    ids: list[int] = []
    body["stream"] = True
    async with client.stream("POST", base_url + "/v1/chat/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                payload = json.loads(line[6:])
                for choice in payload.get("choices") or []:
                    ids += choice.get("token_ids") or []
    return Result(time.perf_counter() - started, len(ids), ids)


async def run_concurrent(
    base_url: str,
    *,
    model: str,
    prompts: list[str],
    max_tokens: int,
    concurrency: int,
    headers: dict[str, str],
    stream: bool = True,
    sampling: dict | None = None,
) -> tuple[float, list[Result]]:
    """All prompts, `concurrency` at a time; returns (wall seconds, results in prompt order)."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(prompt: str) -> Result:
            async with semaphore:
                return await chat(
                    client,
                    base_url,
                    model=model,
                    prompt=prompt,
                    max_tokens=max_tokens,
                    headers=headers,
                    stream=stream,
                    sampling=sampling,
                )

        started = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - started, list(results)


async def paired_latencies(
    direct_url: str, ace_url: str, *, model: str, ace_model: str, prompt: str, n: int, headers: dict[str, str]
) -> tuple[list[float], list[float]]:
    """n sequential requests each way, interleaved (so drifts hit both), max_tokens 1, non-streaming."""
    direct, ace = [], []
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(3):  # warm both connections and caches
            await chat(client, direct_url, model=model, prompt=prompt, max_tokens=1, headers={})
            await chat(client, ace_url, model=ace_model, prompt=prompt, max_tokens=1, headers=headers)
        for _ in range(n):
            direct.append(
                (await chat(client, direct_url, model=model, prompt=prompt, max_tokens=1, headers={})).latency_s
            )
            ace.append(
                (await chat(client, ace_url, model=ace_model, prompt=prompt, max_tokens=1, headers=headers)).latency_s
            )
    return direct, ace


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
