"""Prod serves the request fields real clients send exactly as vLLM does: off and prod side by side.

Against the real vLLM serving the demo target, a real worker on the local path (the demo's path) and real Redis.
Each variant (stop strings that span tokens and drafts, several stop strings, a stop at the first token,
stop_token_ids, min_tokens, ignore_eos, include_stop_str_in_output, echo, n = 1, chat with a system prompt, the
length fields per endpoint kind) is sent whole and streamed with include_usage, first in off, then in prod.
Claims (equalities, no tolerance): the text, finish_reason, stop_reason and usage are identical; every prod
request is recorded `speculated` on the local path (after one warm-up request that waits until the worker has
loaded the models: on a loaded machine its first jobs may fall back, by design, while it loads).

The stop strings are cut out of off's own greedy output, so that they occur: in the middle of the text (they
span several tokens; with K = 3 most also span a verification step), at its very start, and one that never
occurs.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from speculation.models import StageRecord
from speculation.services.drafts import register_draft
from speculation.services.policies import update_policy
from tests.support.stack import register_probed_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.worker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

K = 3
MAX_TOKENS = 32
PROMPT = "def fibonacci(n):"
CHAT = [
    {"role": "system", "content": "You complete Python code."},
    {"role": "user", "content": "class Stack:\n    def __init__(self):"},
]


def _post(ace_server, token: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        ace_server.url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=180
    )  # fmt: skip


def _outcome(ace_server, token: str, path: str, body: dict, *, stream: bool) -> dict:
    """What a client sees: text, finish_reason, stop_reason, usage (stream: joined from the chunks)."""
    reply = _post(
        ace_server,
        token,
        path,
        {**body, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})},
    )
    assert reply.status_code == 200, reply.text
    chat = path.endswith("chat/completions")
    if not stream:
        choice = reply.json()["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return {
            "text": text,
            "finish_reason": choice["finish_reason"],
            "stop_reason": choice.get("stop_reason"),
            "usage": reply.json()["usage"],
        }
    out = {"text": "", "finish_reason": None, "stop_reason": None, "usage": None}
    for line in reply.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        if event.get("usage"):
            out["usage"] = event["usage"]
        for choice in event.get("choices") or []:
            out["text"] += (choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or ""
            if choice.get("finish_reason"):
                out["finish_reason"], out["stop_reason"] = choice["finish_reason"], choice.get("stop_reason")
    return out


def _variants(ace_server, token: str, model: str) -> list[tuple[str, str, dict]]:
    """(name, path, body): stop strings cut out of off's own output for the same prompt."""
    base = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    plain = _post(ace_server, token, "/v1/completions", base).json()["choices"][0]
    text, ids = plain["text"], plain["token_ids"]
    assert len(text) > 30 and len(ids) == MAX_TOKENS, plain  # the demo target writes on without stopping
    base.pop("return_token_ids")
    middle, late = text[12:20], text[24:29]
    chat = {"model": model, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    chat_text = _post(ace_server, token, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    completions = "/v1/completions"
    return [
        ("stop string spanning tokens", completions, {**base, "stop": middle}),
        ("several stop strings", completions, {**base, "stop": ["never occurs", late, middle]}),
        ("stop at the first token", completions, {**base, "stop": [text[:1]]}),
        ("include_stop_str_in_output", completions, {**base, "stop": [middle], "include_stop_str_in_output": True}),
        ("stop_token_ids", completions, {**base, "stop_token_ids": [ids[6]]}),
        ("min_tokens past an early stop string", completions, {**base, "stop": [text[:3]], "min_tokens": 4}),
        ("ignore_eos", completions, {**base, "ignore_eos": True, "max_tokens": 12}),
        ("echo", completions, {**base, "echo": True, "stop": [middle]}),
        ("n = 1", completions, {**base, "n": 1}),
        ("completions ignore max_completion_tokens", completions, {**base, "max_completion_tokens": 20}),
        ("chat with a system prompt", "/v1/chat/completions", chat),
        ("chat stop string", "/v1/chat/completions", {**chat, "stop": [chat_text[10:16]], "n": 1}),
        ("chat max_completion_tokens", "/v1/chat/completions", {**chat, "max_completion_tokens": 9}),
    ]


def _warm_up(ace_server, token: str, endpoint, *, tries: int = 5) -> int:
    """Until the worker has loaded the target and draft and speculated one request (on a loaded machine the
    first jobs may outlast the gateway's timeouts and fall back, as designed); the prod records so far."""
    body = {"model": endpoint.name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    for attempt in range(1, tries + 1):
        assert _post(ace_server, token, "/v1/completions", body).status_code == 200
        records = _records(endpoint, count=attempt)
        if records[-1].action == "speculated":
            return len(records)
    raise AssertionError(f"the worker never speculated: {[(r.action, r.reason) for r in records]}")


def _records(endpoint, *, count: int, timeout_s: float = 120.0) -> list[StageRecord]:
    deadline = time.monotonic() + timeout_s
    found: list[StageRecord] = []
    while time.monotonic() < deadline:
        found = list(StageRecord.objects.filter(endpoint=endpoint, mode="prod").order_by("id"))
        if len(found) >= count:
            return found
        time.sleep(0.3)
    raise AssertionError(f"expected {count} prod records, found {len(found)}")


def test_prod_answers_every_field_variant_as_off_does_and_speculates_each(
    ace_server, token, vllm_server, demo_pair, celery_worker
):
    # given: the demo endpoint, its draft and target directory (prod on the local path, the demo's)
    endpoint = register_probed_endpoint(name="demo", base_url=vllm_server.base_url)
    draft = register_draft(name="demo-draft", kind="draft_model", path=str(demo_pair.draft_dir))
    update_policy(endpoint=endpoint, mechanism="draft_model", draft=draft, k=K, target_path=str(demo_pair.target_dir))
    variants = _variants(ace_server, token, endpoint.name)
    runs = [(name, path, body, stream) for name, path, body in variants for stream in (False, True)]
    # when: every variant in off, then in prod
    off = [_outcome(ace_server, token, path, body, stream=stream) for _, path, body, stream in runs]
    policy = update_policy(endpoint=endpoint, mode="prod")
    assert policy.resolved_path == "local"  # auto: local before remote until measured (services/path_choice)
    warm = _warm_up(ace_server, token, endpoint)
    prod = [_outcome(ace_server, token, path, body, stream=stream) for _, path, body, stream in runs]
    # then: identical answers, and prod speculated every one of them
    differ = [
        (f"{name} ({'streamed' if stream else 'whole'})", want, got)
        for (name, _, _, stream), want, got in zip(runs, off, prod, strict=True)
        if got != want
    ]
    assert not differ, differ
    assert {o["finish_reason"] for o in off} == {"stop", "length"}  # both endings are exercised
    assert any(isinstance(o["stop_reason"], int) for o in off) and any(isinstance(o["stop_reason"], str) for o in off)
    records = _records(endpoint, count=warm + len(runs))[warm:]
    assert [(r.action, r.path) for r in records] == [("speculated", "local")] * len(runs), [
        (r.action, r.reason) for r in records
    ]
    assert [r.output_tokens for r in records] == [o["usage"]["completion_tokens"] for o in off]
