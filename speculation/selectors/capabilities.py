"""Read what the last probe found about an endpoint (keys documented in fleet/adapters/base.py)."""

from __future__ import annotations

from typing import Any

from fleet.adapters import wire_for
from fleet.models import Endpoint


def _caps(endpoint: Endpoint) -> dict[str, Any]:
    return endpoint.capabilities or {}


def tokenizer_fingerprint(endpoint: Endpoint) -> str:
    return str(_caps(endpoint).get("tokenizer_fingerprint") or "")


def native_speculation(endpoint: Endpoint) -> bool:
    return bool(_caps(endpoint).get("native_speculation"))


def can_score_token_prompts(endpoint: Endpoint) -> bool:
    """Remote verification needs token-id prompts scored by token id, the way the server kind's adapter scores
    them (vLLM's prompt_logprobs, SGLang's return_logprob; fleet.adapters.wire), and the probe found it works."""
    caps = _caps(endpoint)
    method = wire_for(endpoint.kind).scoring_method
    return bool(caps.get("token_id_prompts")) and method is not None and caps.get("prompt_scoring_method") == method
