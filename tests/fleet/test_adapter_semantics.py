"""What each server kind means by a request's length fields (fleet.adapters.semantics), as vLLM 0.32 reads them."""

from __future__ import annotations

import pytest

from fleet.adapters import semantics_for


@pytest.mark.parametrize(
    ("kind", "body", "want"),
    [
        ("completion", {"max_completion_tokens": 20}, 16),  # completions ignore it: the default 16
        ("completion", {"max_tokens": None}, 16),
        ("completion", {"max_tokens": 40, "max_completion_tokens": 20}, 40),
        ("chat", {"max_completion_tokens": 20, "max_tokens": 40}, 20),
        ("chat", {"max_tokens": 40}, 40),
        ("chat", {}, 1000),  # what the context leaves
        ("chat", {"max_tokens": 1024}, 1000),  # cut to the context, not refused
    ],
)
def test_vllm_reads_the_length_fields_per_endpoint_kind(kind, body, want):
    assert semantics_for("vllm").max_new_tokens(kind=kind, body=body, prompt_len=24, max_context=1024) == want


def test_a_budget_above_the_context_itself_is_refused_as_the_server_refuses_it():
    with pytest.raises(ValueError, match="5000 output tokens"):
        semantics_for("vllm").max_new_tokens(kind="chat", body={"max_tokens": 5000}, prompt_len=5, max_context=1024)


def test_every_server_kind_has_semantics():
    for kind in ("vllm", "sglang", "openai"):
        assert semantics_for(kind).max_new_tokens(kind="completion", body={}, prompt_len=1, max_context=64) == 16
