"""prod_coverage: the share of a mixed greedy request set that prod serves speculatively (bench_gateway).

The set mixes what real clients send besides the prompt: stop strings (one, several, code-completion style),
stop_token_ids, min_tokens, ignore_eos, include_stop_str_in_output, echo, n = 1, a system prompt, the length
fields of either endpoint, streams with include_usage (8 variants per prompt), plus one request prod cannot serve
exactly (logprobs), so the figure is a share of a mixed set, not of requests chosen to pass.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

SYSTEM = "You are a helpful assistant that writes Python."


def mixed_requests(prompts: list[str], *, model: str, max_tokens: int) -> list[tuple[str, dict[str, Any]]]:
    """(path, body) per request: every variant below for every prompt, then the logprobs one; all greedy."""
    out: list[tuple[str, dict[str, Any]]] = []
    for prompt in prompts:
        chat = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0}
        text = {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens}
        usage = {"stream": True, "stream_options": {"include_usage": True}}
        out += [
            ("/v1/chat/completions", {**chat, "max_tokens": max_tokens}),
            ("/v1/chat/completions", {**chat, "max_completion_tokens": max_tokens, "stop": ["\n\n"], **usage}),
            (
                "/v1/chat/completions",
                {
                    **chat,
                    "messages": [{"role": "system", "content": SYSTEM}, *chat["messages"]],
                    "max_tokens": max_tokens,
                    "n": 1,
                },
            ),
            ("/v1/completions", {**text, "stop": ["\ndef ", "\nclass ", "\n\n\n"]}),
            ("/v1/completions", {**text, "stop": "\n", "include_stop_str_in_output": True, **usage}),
            ("/v1/completions", {**text, "stop_token_ids": [13], "min_tokens": 4}),
            ("/v1/completions", {**text, "ignore_eos": True}),
            ("/v1/completions", {**text, "echo": True, "stop": [")"]}),
        ]
    # One request prod cannot serve exactly (logprobs), counted against the coverage like any other.
    out.append(("/v1/completions", {"model": model, "prompt": prompts[0], "temperature": 0, "logprobs": 1}))
    return out


async def send_all(base_url: str, requests: list[tuple[str, dict[str, Any]]], *, headers: dict[str, str]) -> list[int]:
    """Send each request in turn (one at a time: coverage, not load); the HTTP status of each."""
    statuses = []
    async with httpx.AsyncClient(timeout=600) as client:
        for path, body in requests:
            if body.get("stream"):
                async with client.stream("POST", base_url + path, json=body, headers=headers) as response:
                    async for _ in response.aiter_bytes():
                        pass
            else:
                response = await client.post(base_url + path, json=body, headers=headers)
            statuses.append(response.status_code)
    return statuses


def run(base_url: str, requests: list[tuple[str, dict[str, Any]]], *, headers: dict[str, str]) -> list[int]:
    return asyncio.run(send_all(base_url, requests, headers=headers))


def summarize(records: list[dict]) -> dict[str, Any]:
    """prod_coverage = speculated / all prod records of the set, with the reasons of the rest."""
    speculated = sum(1 for r in records if r["action"] == "speculated")
    reasons: dict[str, int] = {}
    for r in records:
        if r["action"] != "speculated":
            key = f"{r['action']}: {r['reason'][:80]}"
            reasons[key] = reasons.get(key, 0) + 1
    return {
        "prod_coverage": round(speculated / len(records), 4) if records else None,
        "prod_coverage_requests": len(records),
        "prod_coverage_not_speculated": reasons,
    }
