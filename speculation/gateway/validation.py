"""Request bodies the model server would refuse, refused by the gateway first with the server's kind of 400.

Shadow and prod read the body themselves (sampling, prompt, limits) and may speculate; a body the server
would answer with 400 must get a 400, never a 500 or a speculated answer. Off mode relays the server's own
answer, errors included, and is not checked here.

The rules follow vLLM's OpenAI protocol (the strictest server ACE fronts): its types as pydantic's lax mode
reads them ("8" is an integer, "yes" a boolean), and the ranges its sampling parameters enforce. Fields not
listed here are left to the server. `checked(body, kind=...)` returns the body with those scalars coerced (what
ACE reads) and the first problem found, or None.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.http import HttpResponse

from speculation.gateway.errors import error_response

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


@dataclass(frozen=True)
class Problem:
    param: str
    message: str
    code: str = "invalid_value"

    def response(self, request_id: str) -> HttpResponse:
        return error_response(400, self.message, code=self.code, request_id=request_id, param=self.param)


Check = Callable[[Any], str]  # "" when the value is acceptable, else what it must be

# The server validates with pydantic in lax mode: "8" is an integer, 1 and "yes" are booleans, "0.5" is a
# number. Such values pass (as the server would take them); ACE reads the coerced value (`checked`).
_TRUE = {"1", "true", "yes", "on", "t", "y"}
_FALSE = {"0", "false", "no", "off", "f", "n"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_int(value: Any) -> int | None:
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def as_float(value: Any) -> float | None:
    if isinstance(value, bool | int):
        number_ = float(value) if abs(value) < 2**1000 else math.inf
    elif isinstance(value, float):
        number_ = value
    elif isinstance(value, str):
        try:
            number_ = float(value.strip())
        except ValueError:
            return None
    else:
        return None
    return number_ if math.isfinite(number_) else None


def as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    return None


def integer(low: int = INT64_MIN, high: int = INT64_MAX) -> Check:
    """An integer in [low, high]; the server's integers are 64-bit, so that is the widest range."""

    def check(value: Any) -> str:
        value = as_int(value)
        if value is None:
            return "an integer"
        if not low <= value <= high:
            return _range("an integer", low if low != INT64_MIN else None, high if high != INT64_MAX else None)
        return ""

    check.coerce = as_int  # type: ignore[attr-defined]
    return check


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False) -> Check:
    def check(value: Any) -> str:
        value = as_float(value)
        if value is None:
            return "a finite number"
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            return _range("a number", low, high, low_open=low_open)
        return ""

    check.coerce = as_float  # type: ignore[attr-defined]
    return check


def _range(what: str, low: float | None, high: float | None, *, low_open: bool = False) -> str:
    if low is None and high is None:
        return f"{what} that fits in 64 bits"
    if low is not None and high is not None:
        return f"{what} in {'(' if low_open else '['}{low:g}, {high:g}]"
    if low is not None:
        return f"{what} {'>' if low_open else '>='} {low:g}"
    return f"{what} <= {high:g}"


def boolean(value: Any) -> str:
    return "" if as_bool(value) is not None else "a boolean"


boolean.coerce = as_bool  # type: ignore[attr-defined]


def string(value: Any) -> str:
    return "" if isinstance(value, str) else "a string"


def stop(value: Any) -> str:
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        return ""
    return "a string or a list of strings"


def token_ids(value: Any) -> str:
    if isinstance(value, list) and all(_is_int(t) and 0 <= t <= INT64_MAX for t in value):
        return ""
    return "a list of non-negative integer token ids"


def an_object(value: Any) -> str:
    return "" if isinstance(value, dict) else "an object"


def logit_bias(value: Any) -> str:
    if isinstance(value, dict) and all(as_float(v) is not None for v in value.values()):
        return ""
    return "an object mapping token ids to numbers"


def stream_options(value: Any) -> str:
    if not isinstance(value, dict):
        return "an object"
    for key in ("include_usage", "continuous_usage_stats"):
        if value.get(key) is not None and as_bool(value[key]) is None:
            return f"an object whose {key} is a boolean"
    return ""


def prompt(value: Any) -> str:
    """A non-empty string, a non-empty list of token ids, or a non-empty batch of either."""
    must = "a non-empty string, a non-empty list of token ids, or a non-empty list of those"
    if isinstance(value, str):
        return "" if value else must
    if not isinstance(value, list) or not value:
        return must
    if all(_is_int(t) for t in value):
        return "" if not token_ids(value) else must
    for item in value:
        if isinstance(item, str) and item:
            continue
        if isinstance(item, list) and item and not token_ids(item):
            continue
        return must
    return ""


def messages(value: Any) -> str:
    if not isinstance(value, list) or not value:
        return "a non-empty list of messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"a list of message objects (item {i} is not an object)"
        if not isinstance(message.get("role"), str):
            return f"a list of messages with a string role (item {i})"
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            return f"a list of messages whose content is a string, a list of parts or null (item {i})"
        if isinstance(content, list) and not all(isinstance(part, dict) for part in content):
            return f"a list of messages whose content parts are objects (item {i})"
    return ""


# Shared by /v1/completions and /v1/chat/completions (vLLM's SamplingParams ranges).
COMMON: dict[str, Check] = {
    "stream": boolean,
    "stream_options": stream_options,
    "max_tokens": integer(1),
    "temperature": number(0, 2),
    "top_p": number(0, 1, low_open=True),
    "top_k": integer(-1),
    "min_p": number(0, 1),
    "n": integer(1),
    "seed": integer(),
    "presence_penalty": number(-2, 2),
    "frequency_penalty": number(-2, 2),
    "repetition_penalty": number(0, low_open=True),
    "stop": stop,
    "stop_token_ids": token_ids,
    "logit_bias": logit_bias,
    "user": string,
    "ignore_eos": boolean,
    "min_tokens": integer(0),
    "skip_special_tokens": boolean,
    "include_stop_str_in_output": boolean,
    "return_token_ids": boolean,
    "response_format": an_object,
}
COMPLETION: dict[str, Check] = {
    **COMMON,
    "prompt": prompt,
    "echo": boolean,
    "max_tokens": integer(0),  # 0 only with echo (the prompt's logprobs, no generation): checked below
    "logprobs": integer(-1),
    "best_of": integer(1),
    "suffix": string,
    "add_special_tokens": boolean,
}
CHAT: dict[str, Check] = {
    **COMMON,
    "messages": messages,
    "max_completion_tokens": integer(1),
    "logprobs": boolean,
    "top_logprobs": integer(-1),
    "add_generation_prompt": boolean,
    "continue_final_message": boolean,
}
REQUIRED = {"completion": "prompt", "chat": "messages"}


def checked(body: dict[str, Any], *, kind: str) -> tuple[dict[str, Any], Problem | None]:
    """(the body as the server reads it, the first field it would refuse or None). kind: completion | chat.

    The body returned has lax values coerced ("8" -> 8, "yes" -> True) for ACE's own reading; the bytes sent
    upstream stay the client's.
    """
    required = REQUIRED[kind]
    if body.get(required) is None:
        message = f"Missing required parameter: '{required}'."
        return body, Problem(required, message, code="missing_required_parameter")
    coerced = dict(body)
    for name, check in (COMPLETION if kind == "completion" else CHAT).items():
        value = body.get(name)
        if value is None:
            continue
        must = check(value)
        if must:
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            return body, Problem(name, f"Invalid value for '{name}': expected {must}, got {shown}.")
        coerce = getattr(check, "coerce", None)  # scalars: the value as the server takes it
        if coerce is not None:
            coerced[name] = coerce(value)
    if kind == "completion" and coerced.get("max_tokens") == 0 and coerced.get("echo") is not True:
        message = "Invalid value for 'max_tokens': expected an integer >= 1 (0 only with echo)."
        return body, Problem("max_tokens", message)
    return coerced, None


def problem(body: dict[str, Any], *, kind: str) -> Problem | None:
    """The first field of `body` the server would refuse (None: nothing to refuse)."""
    return checked(body, kind=kind)[1]
