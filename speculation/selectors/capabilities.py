"""Read what the last probe found about an endpoint (keys documented in fleet/adapters/base.py)."""

from __future__ import annotations

from typing import Any

from fleet.models import Endpoint


def _caps(endpoint: Endpoint) -> dict[str, Any]:
    return endpoint.capabilities or {}


def tokenizer_fingerprint(endpoint: Endpoint) -> str:
    return str(_caps(endpoint).get("tokenizer_fingerprint") or "")


def native_speculation(endpoint: Endpoint) -> bool:
    return bool(_caps(endpoint).get("native_speculation"))


def can_score_token_prompts(endpoint: Endpoint) -> bool:
    """Remote verification needs token-id prompts scored with vLLM's prompt_logprobs."""
    caps = _caps(endpoint)
    return bool(caps.get("token_id_prompts")) and caps.get("prompt_scoring_method") == "prompt_logprobs"
