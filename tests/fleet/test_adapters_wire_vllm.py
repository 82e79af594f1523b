"""vLLM's request-time wire format against a real vLLM (CPU build) serving the demo target: what the adapter
builds is accepted, and what it reads back means what the callers rely on."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from fleet.adapters import WireRequest, wire_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM = wire_for("vllm")
PROMPT = "def fibonacci(n):"
TIMEOUT_S = 120


def send(base_url: str, request: WireRequest) -> Any:
    response = httpx.request(request.method, base_url + request.path, json=request.json, timeout=TIMEOUT_S)
    response.raise_for_status()
    return response.json()


def prompt_ids(server) -> list[int]:
    return VLLM.parse_tokenize(send(server.base_url, VLLM.tokenize(model=server.model, prompt=PROMPT)))


def greedy(server, ids: list[int], max_tokens: int) -> list[int]:
    request = VLLM.continuation(
        model=server.model, token_ids=ids, max_tokens=max_tokens, fields={"temperature": 0}, stream=False
    )
    piece = VLLM.parse_continuation(send(server.base_url, request))
    assert piece is not None
    return piece.token_ids


def test_tokenize_and_detokenize_round_trip(vllm_server):
    ids = prompt_ids(vllm_server)
    text = VLLM.parse_detokenize(send(vllm_server.base_url, VLLM.detokenize(model=vllm_server.model, token_ids=ids)))
    assert ids and PROMPT in text


def test_scoring_the_greedy_output_ranks_every_output_token_first(vllm_server):
    # given the target's own greedy continuation of a prompt
    ids = prompt_ids(vllm_server)
    output = greedy(vllm_server, ids, 8)
    assert len(output) == 8
    # when the whole sequence is scored
    sequence = ids + output
    request = VLLM.score(model=vllm_server.model, token_ids=sequence, top_n=3)
    scored = VLLM.parse_score(send(vllm_server.base_url, request), token_ids=sequence, top_n=3)
    # then each output token is the argmax where it was generated, and the greedy next token follows
    assert len(scored.positions) == len(sequence)
    for j, token in enumerate(output, start=len(ids)):
        position = scored.positions[j]
        assert position.is_argmax(token) and position.argmax() == token
        assert len(position.top) == 3
    assert scored.generated == greedy(vllm_server, sequence, 1)


def test_a_streamed_continuation_carries_the_same_token_ids(vllm_server):
    ids = prompt_ids(vllm_server)
    request = VLLM.continuation(
        model=vllm_server.model, token_ids=ids, max_tokens=6, fields={"temperature": 0}, stream=True
    )
    streamed: list[int] = []
    finish = None
    with httpx.stream(request.method, vllm_server.base_url + request.path, json=request.json, timeout=TIMEOUT_S) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            piece = VLLM.parse_continuation(json.loads(line[len("data:") :]))
            if piece is not None:
                streamed.extend(piece.token_ids)
                finish = piece.finish_reason or finish
    assert streamed == greedy(vllm_server, ids, 6)
    assert finish in ("length", "stop")


def test_the_baseline_generates_the_whole_budget(vllm_server):
    request = VLLM.baseline(model=vllm_server.model, prompt=prompt_ids(vllm_server), max_tokens=12)
    assert VLLM.parse_baseline(send(vllm_server.base_url, request)) == 12


def test_token_ids_of_a_chat_answer_are_read_and_stripped(vllm_server):
    body = {
        "model": vllm_server.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 4,
        "temperature": 0,
        **VLLM.token_ids_fields(),
    }
    answer = send(vllm_server.base_url, WireRequest("POST", "/v1/chat/completions", body))
    seen = VLLM.take_token_ids(answer, strip=True)
    assert seen.prompt_ids and len(seen.output_ids) == answer["usage"]["completion_tokens"]
    assert answer["prompt_token_ids"] is None and answer["choices"][0]["token_ids"] is None


def test_spec_counters_of_the_ngram_server_grow_with_a_request(vllm_ngram_server):
    def scrape() -> dict[str, float]:
        request = VLLM.spec_counters()
        text = httpx.request(request.method, vllm_ngram_server.base_url + request.path, timeout=TIMEOUT_S).text
        return VLLM.parse_spec_counters(text)

    before = scrape()
    repeat = "x = 1\ny = 2\n" * 8  # n-gram lookup finds its drafts in a repetitive prompt
    request = VLLM.baseline(model=vllm_ngram_server.model, prompt=repeat, max_tokens=24)
    send(vllm_ngram_server.base_url, request)
    stats = VLLM.spec_stats(before, scrape())
    assert stats["target_passes"] > 0 and stats["drafted_tokens"] > 0
    assert stats["k"] and len(stats["per_position_acceptance"]) == stats["k"]
