"""The remote path's sampled target: from a server's top-N prompt log-probabilities (vLLM's entry shape, read by
its adapter's wire format), the processed distribution at top_k < N equals the one from the full logits; a tie
at the cut is refused."""

from __future__ import annotations

import pytest
import torch

from fleet.adapters import PositionScores, wire_for
from speculation.engine import SamplingParams, probs_from_logits
from speculation.worker.paths.remote import RemoteTarget, RemoteVerificationError


def _target(top_k: int, top_n: int = 8, vocab: int = 64) -> RemoteTarget:
    return RemoteTarget(
        client=None, base_url="http://unused", model="m", headers={}, wire=wire_for("vllm"), vocab_size=vocab,
        max_context=512, top_k=top_k, top_n=top_n,
    )  # fmt: skip


def _entry(logits: torch.Tensor, top_n: int, own_token: int) -> PositionScores:
    """vLLM's prompt_logprobs entry (the top-N by rank, plus the prompt's own token with its rank), as read by
    the vLLM wire format."""
    logprobs = torch.log_softmax(logits.double(), -1)
    order = logprobs.argsort(descending=True).tolist()
    shown = set(order[:top_n]) | {own_token}
    entry = {str(t): {"logprob": float(logprobs[t]), "rank": order.index(t) + 1} for t in shown}
    answer = {"choices": [{"index": 0, "token_ids": [0], "prompt_logprobs": [None, entry]}]}
    return wire_for("vllm").parse_score(answer, token_ids=[0, own_token], top_n=top_n).positions[1]


@pytest.mark.parametrize(
    "params", [SamplingParams(0.7, 5, 0.9), SamplingParams(1.3, 3, 1.0), SamplingParams(0.5, 7, 0.8)]
)
def test_top_k_below_n_gives_the_exact_processed_distribution(params):
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(64, generator=generator) * 2
        own = int(logits.argmin())  # a prompt token far outside the top N: returned, but must not matter
        row = torch.full((64,), float("-inf"))
        _target(params.top_k)._fill(row, _entry(logits, 8, own))
        torch.testing.assert_close(probs_from_logits(row, params), probs_from_logits(logits, params), atol=1e-6, rtol=0)


def test_a_tie_at_the_top_k_cut_is_refused():
    logits = torch.arange(64, dtype=torch.float32).flip(0)
    logits[3] = logits[2]  # ranks 3 and 4 tie, and top_k = 3 cuts between them
    with pytest.raises(RemoteVerificationError, match="tie"):
        _target(3)._fill(torch.full((64,), float("-inf")), _entry(logits, 8, 0))
