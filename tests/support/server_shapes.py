"""Routes for the loopback stub servers (the `http_stub` fixture): OpenAI-compatible and SGLang response shapes.

The OpenAI shapes are the ones a real vLLM 0.32 returned here (shared/ANCHORS.md section 5); the SGLang
shapes follow SGLang's own definitions (sgl-project/sglang: srt/entrypoints/http_server.py `get_server_info`,
`/generate`; srt/entrypoints/openai/serving_tokenize.py; openai/protocol.py `ModelCard`). SGLang does not
run on this machine, so these stubs are the only way to exercise its adapter.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

MODEL = "stub-model"
VOCAB_TOKENS = 512


def fake_token_ids(text: str) -> list[int]:
    """A deterministic stand-in tokenization: one id per 4 characters."""
    return [1 + (sum(map(ord, text[i : i + 4])) % (VOCAB_TOKENS - 1)) for i in range(0, len(text), 4)]


def sse(events: list[dict[str, Any]]) -> tuple[int, dict[str, str], bytes]:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return 200, {"content-type": "text/event-stream"}, body.encode()


def json_reply(status: int, body: Any) -> tuple[int, dict[str, str], bytes]:
    return status, {"content-type": "application/json"}, json.dumps(body).encode()


def models_route(request) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": MODEL, "object": "model", "root": MODEL, "max_model_len": 2048}]}


def openai_completions(*, max_logprobs: int = 5) -> Callable:
    """/v1/completions: streaming, token-id prompts, and echo+logprobs up to max_logprobs (400 above)."""

    def route(request):
        body = request.json()
        if body.get("stream"):
            events = [
                {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": f"t{i}"}]}
                for i in range(body.get("max_tokens", 16))
            ]
            events.append({"id": "c", "choices": [], "usage": {"completion_tokens": len(events)}})
            return sse(events)
        if body.get("echo"):
            n = body.get("logprobs") or 0
            if n > max_logprobs:
                return json_reply(400, {"error": {"message": f"logprobs must be <= {max_logprobs}", "code": 400}})
            tokens = ["a", "b", "c", "d"]
            top = [None] + [{f"x{j}": -1.0 - j for j in range(n)} for _ in tokens[1:]]
            return {
                "choices": [
                    {
                        "index": 0,
                        "text": "abcd",
                        "logprobs": {
                            "tokens": tokens,
                            "token_logprobs": [None, -1.0, -2.0, -3.0],
                            "top_logprobs": top,
                            "text_offset": [0, 1, 2, 3],
                        },
                    }
                ]
            }
        return {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}], "usage": {"completion_tokens": 1}}

    return route


def openai_routes(**kwargs: Any) -> dict:
    return {("GET", "/v1/models"): models_route, ("POST", "/v1/completions"): openai_completions(**kwargs)}


def sglang_server_info(*, speculative_algorithm: str | None = None, version: str = "0.5.4") -> dict[str, Any]:
    """Shape of GET /get_server_info: server args + scheduler info + internal_states + version."""
    return {
        "model_path": MODEL,
        "tokenizer_path": MODEL,
        "served_model_name": MODEL,
        "context_length": 4096,
        "speculative_algorithm": speculative_algorithm,
        "speculative_num_steps": 3 if speculative_algorithm else None,
        "speculative_eagle_topk": 1 if speculative_algorithm else None,
        "speculative_num_draft_tokens": 4 if speculative_algorithm else None,
        "max_total_num_tokens": 100000,
        "max_req_input_len": 4090,
        "internal_states": [{"avg_spec_accept_length": 2.1 if speculative_algorithm else None}],
        "version": version,
    }


def sglang_generate(request) -> dict[str, Any]:
    """POST /generate with input_ids, return_logprob, logprob_start_len, top_logprobs_num."""
    body = request.json()
    ids = body["input_ids"]
    meta: dict[str, Any] = {
        "id": "rid",
        "finish_reason": {"type": "length", "length": 1},
        "prompt_tokens": len(ids),
        "completion_tokens": 1,
        "cached_tokens": 0,
    }
    if body.get("return_logprob"):
        n = body.get("top_logprobs_num", 0)
        meta["input_token_logprobs"] = [[None, ids[0], None]] + [[-1.5, t, None] for t in ids[1:]]
        meta["input_top_logprobs"] = [None] + [[[-1.0 - j, j, None] for j in range(n)] for _ in ids[1:]]
        meta["output_token_logprobs"] = [[-0.5, 7, None]]
        meta["output_top_logprobs"] = [[[-0.5, 7, None]]]
    return {"text": "x", "output_ids": [7], "meta_info": meta}


def sglang_routes(*, speculative_algorithm: str | None = None, info_path: str = "/get_server_info") -> dict:
    def tokenize(request):
        tokens = fake_token_ids(request.json()["prompt"])
        return {"tokens": tokens, "count": len(tokens), "max_model_len": 4096}

    def detokenize(request):
        return {"text": f"<decoded {len(request.json()['tokens'])} tokens>"}

    return {
        ("GET", "/v1/models"): models_route,
        ("GET", info_path): lambda request: sglang_server_info(speculative_algorithm=speculative_algorithm),
        ("GET", "/get_model_info"): lambda request: {"model_path": MODEL, "is_generation": True},
        ("POST", "/tokenize"): tokenize,
        ("POST", "/detokenize"): detokenize,
        ("POST", "/generate"): sglang_generate,
        ("POST", "/v1/completions"): openai_completions(),
    }
