"""Which requests prod can serve exactly. Anything else goes plain, recorded as skipped with the reason."""

from __future__ import annotations

from typing import Any

# Fields prod serves exactly (or that do not change the output); any other field set to a non-default
# value sends the request plain.
_ALLOWED = {
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stream",
    "stream_options",
    "user",
    "seed",
    "n",
    "return_token_ids",
    "logprobs",
    "top_logprobs",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
}
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "echo": False}


def unservable_reason(body: dict[str, Any], *, kind: str) -> str:
    """Why prod cannot serve this request exactly ("" when it can). Prod is greedy-exact: temperature 0."""
    if body.get("n") not in (None, 1):
        return "n > 1 is not served by prod"
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        return "logprobs requested"
    for name, neutral in _NEUTRAL.items():
        if body.get(name) not in (None, neutral):
            return f"unsupported parameter {name}={body[name]!r}"
    extra = sorted(name for name, value in body.items() if name not in _ALLOWED and value is not None)
    if extra:
        return f"unsupported parameter {extra[0]}"
    if body.get("temperature") is None:
        return "temperature not given: the server default samples, and prod is exact for temperature 0 only"
    if float(body["temperature"]) != 0.0:
        return f"temperature {body['temperature']} > 0: prod is exact for greedy requests only"
    if kind == "completion":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return "a batch of prompts is not served by prod"
    elif not isinstance(body.get("messages"), list):
        return "messages must be a list"
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        return "max_tokens must be a positive integer"
    return ""
