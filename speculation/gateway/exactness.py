"""Which requests prod can serve exactly. Anything else goes plain, recorded as skipped with the reason."""

from __future__ import annotations

from typing import Any

from speculation.models import VerificationPath
from speculation.openai_fields import NEUTRAL, SERVED_BY_PROD


def unservable_reason(body: dict[str, Any], *, kind: str) -> str:
    """Why prod cannot serve this request exactly ("" when it can).

    Sampling (temperature, top-k, top-p, seed) is judged per path by speculation.gateway.sampling."""
    if body.get("n") not in (None, 1):
        return "n > 1 is not served by prod"
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        return "logprobs requested"
    for name, neutral in NEUTRAL.items():
        if body.get(name) not in (None, neutral):
            return f"unsupported parameter {name}={body[name]!r}"
    extra = sorted(name for name, value in body.items() if name not in SERVED_BY_PROD and value is not None)
    if extra:
        return f"unsupported parameter {extra[0]}"
    if body.get("temperature") is None:
        return "temperature not given: the server samples with its own defaults (generation config), unknown to prod"
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


def stop_fields_reason(body: dict[str, Any], *, kind: str, path: str) -> str:
    """Why prod cannot apply this request's stop / echo / min_tokens / ignore_eos fields as the server does
    ("" when it can; the worker applies them through speculation.worker.paths.stopping). A value the server would
    refuse goes plain too, so that the server's own error reaches the client."""
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            return "stop must be a string or a list of strings"
        if any(not s for s in stops):
            return "stop contains an empty string (the server refuses it)"
    ids = body.get("stop_token_ids")
    if ids is not None and (not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids)):
        return "stop_token_ids must be a list of token ids"
    for name in ("ignore_eos", "include_stop_str_in_output", "echo"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            return f"{name} must be true or false"
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if not _is_int(min_tokens) or min_tokens < 0:
            return "min_tokens must be a non-negative integer"
        if min_tokens and path == VerificationPath.REMOTE:
            return "min_tokens on the remote path: the scoring API's argmax cannot leave out the end tokens"
    if body.get("echo"):
        if kind != "completion":
            return "echo on chat (prepends the last message of the same role) is not served by prod"
        if not isinstance(body.get("prompt"), str):
            return "echo with a token-id prompt is not served by prod (the server has no prompt text to echo)"
    return ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
