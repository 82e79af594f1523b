"""The OpenAI-compatible request as the server reads it: its field names per route, and greediness.

One table for the gateway's validation (which checks each field's value), its exactness rules (which fields prod
serves), the stop fields the worker applies, and the fuzzer. Names and ranges follow vLLM's OpenAI server
(vllm/entrypoints/openai/protocol.py). Standard library only: the web process, the worker and the engine's callers
read it without Django or torch.
"""

from __future__ import annotations

# Fields both /v1/completions and /v1/chat/completions take, besides "model".
COMMON = (
    *("stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed"),
    *("presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "logit_bias"),
    *("user", "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "return_token_ids"),
    "response_format",
)
COMPLETION_ONLY = ("prompt", "echo", "logprobs", "best_of", "suffix", "add_special_tokens")
CHAT_ONLY = (
    *("messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt"),
    "continue_final_message",
)
ROUTE_ONLY = {"completion": COMPLETION_ONLY, "chat": CHAT_ONLY}

# The fields that end a generation early or keep it going; the worker applies them as the server does.
STOP = ("stop", "stop_token_ids", "min_tokens", "ignore_eos", "include_stop_str_in_output")

# Fields prod serves exactly, or that do not change the output; any other field set sends the request plain.
SERVED_BY_PROD = frozenset(
    {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p"}
    | {"stream", "stream_options", "user", "seed", "n", "return_token_ids", "logprobs", "top_logprobs", "echo"}
    | set(STOP)
    | {"presence_penalty", "frequency_penalty", "repetition_penalty"}
)
# Penalties prod serves only at their neutral value.
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS (vllm/v1/sample): a smaller temperature samples greedily


def is_greedy(temperature: object) -> bool:
    """Whether the server decodes greedily at this request temperature. No temperature (None) reads as the
    OpenAI default, 1: sampled; so does a value that is not a number (the server refuses it)."""
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        return False
    return temperature < GREEDY_BELOW
