"""The target identity comparison: the model itself passes, another checkpoint fails, within stated tolerances."""

from __future__ import annotations

import pytest
import torch

from speculation.engine.identity import (
    GREEDY_TIE_NATS,
    LOGPROB_TOLERANCE_NATS,
    Reference,
    compare,
    local_logprobs,
)
from tests.support.models import served_reference, tiny_model

PROMPT = [3, 17, 5, 29, 11, 2, 40, 8]


def _verdict(server, local, **kwargs):
    reference = Reference.from_json(served_reference(server, PROMPT, **kwargs))
    return compare(reference, local_logprobs(local, reference.token_ids))


def test_it_passes_the_served_model_itself():
    model = tiny_model(seed=0)
    verdict = _verdict(model, tiny_model(seed=0))
    assert verdict.mismatch is None
    assert verdict.max_logprob_diff is not None and verdict.max_logprob_diff < 1e-4
    assert verdict.compared_tokens == 8


def test_it_names_the_first_greedy_token_another_checkpoint_does_not_reproduce():
    verdict = _verdict(tiny_model(seed=0), tiny_model(seed=1))
    assert verdict.mismatch is not None and verdict.mismatch.kind == "greedy"
    assert verdict.mismatch.server_token != verdict.mismatch.local_token
    assert verdict.mismatch.nats > GREEDY_TIE_NATS


def test_it_refuses_a_checkpoint_whose_greedy_agrees_but_whose_log_probabilities_do_not():
    # given: the served model's logits scaled by 1.3 (the same argmax everywhere, other probabilities)
    server, local = tiny_model(seed=0), tiny_model(seed=0)
    with torch.no_grad():
        local.output.weight.mul_(1.3)
    # when
    verdict = _verdict(server, local)
    # then: greedy holds, the log-probabilities are caught and measured
    assert verdict.mismatch is not None and verdict.mismatch.kind == "logprobs", verdict
    assert verdict.mismatch.nats > LOGPROB_TOLERANCE_NATS
    assert verdict.max_logprob_diff == verdict.mismatch.nats


def test_noise_well_under_the_tolerance_passes():
    # given: the served model with a relative weight noise of 1e-4 (a tiny model with large logits amplifies it)
    server, local = tiny_model(seed=0), tiny_model(seed=0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in local.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 1e-4 * p.std())
    verdict = _verdict(server, local)
    assert verdict.mismatch is None and verdict.max_logprob_diff < LOGPROB_TOLERANCE_NATS


def test_without_log_probabilities_greedy_alone_decides():
    # given: a server that returns no log-probabilities (the reference has none)
    same = _verdict(tiny_model(seed=0), tiny_model(seed=0), top_n=None)
    other = _verdict(tiny_model(seed=0), tiny_model(seed=1), top_n=None)
    assert same.mismatch is None and same.max_logprob_diff is None
    assert other.mismatch is not None and other.mismatch.kind == "greedy"


def test_a_token_outside_the_local_vocabulary_is_a_mismatch():
    reference = Reference(token_ids=[*PROMPT, 500], prompt_len=len(PROMPT))
    verdict = compare(reference, local_logprobs(tiny_model(seed=0), reference.token_ids))
    assert verdict.mismatch is not None and verdict.mismatch.kind == "vocab"


def test_a_reference_with_nothing_to_compare_is_refused():
    with pytest.raises(ValueError, match="nothing to compare"):
        Reference.from_json({"token_ids": PROMPT, "prompt_len": len(PROMPT), "top_logprobs": None})
