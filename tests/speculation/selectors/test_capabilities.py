"""Which verification paths an endpoint's probe allows: remote scoring as the server kind's adapter speaks it."""

from __future__ import annotations

import pytest

from fleet.models import Endpoint
from speculation.selectors.capabilities import can_score_token_prompts


@pytest.mark.parametrize(
    ("kind", "method", "remote"),
    [
        ("vllm", "prompt_logprobs", True),
        ("sglang", "return_logprob", True),  # SGLang's /generate (shapes from its API; it does not run here)
        ("openai", "echo_logprobs", False),  # keyed by token text: a token id cannot be scored exactly
        ("vllm", "echo_logprobs", False),  # a vLLM that refused prompt_logprobs
        ("sglang", "prompt_logprobs", False),  # not what the SGLang adapter sends
    ],
)
def test_remote_needs_token_id_scoring_the_way_the_server_kind_speaks_it(kind, method, remote):
    endpoint = Endpoint(kind=kind, capabilities={"token_id_prompts": True, "prompt_scoring_method": method})
    assert can_score_token_prompts(endpoint) is remote


def test_remote_needs_token_id_prompts():
    caps = {"token_id_prompts": False, "prompt_scoring_method": "prompt_logprobs"}
    assert can_score_token_prompts(Endpoint(kind="vllm", capabilities=caps)) is False
