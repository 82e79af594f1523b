"""The remote path's scoring call goes out in the endpoint kind's wire format and every failure becomes a
RemoteVerificationError (the worker falls back on it). SGLang's /generate answers come from its API definitions
(tests/support/server_shapes.py): SGLang does not run here; vLLM's real answers are in test_gateway_modes.py."""

from __future__ import annotations

import httpx
import pytest
import torch

from fleet.adapters import wire_for
from speculation.engine import verify_greedy
from speculation.worker.paths.remote import RemoteTarget, RemoteVerificationError, score
from tests.support.server_shapes import json_reply, sglang_generate


def test_sglang_scoring_goes_to_generate_and_reads_top_logprobs(http_stub):
    stub = http_stub({("POST", "/generate"): sglang_generate})
    with httpx.Client() as client:
        scored = score(
            client=client, base_url=stub.base_url, headers={"Authorization": "Bearer k"}, wire=wire_for("sglang"),
            model="m", token_ids=[5, 6, 7], top_n=2,
        )  # fmt: skip
    sent = stub.requests[0]
    assert sent.json()["input_ids"] == [5, 6, 7] and sent.json()["top_logprobs_num"] == 2
    assert sent.headers["authorization"] == "Bearer k"
    assert scored.generated == [7]
    assert [t.token_id for t in scored.positions[2].top] == [0, 1]


def test_a_greedy_step_on_sglang_rejects_a_draft_the_target_does_not_rank_first(http_stub):
    # the stub's top-1 at every position is token 0: a draft of 9 is rejected, 0 is the target's token
    stub = http_stub({("POST", "/generate"): sglang_generate})
    with httpx.Client() as client:
        target = RemoteTarget(
            client=client, base_url=stub.base_url, model="m", headers={}, wire=wire_for("sglang"), vocab_size=16,
            max_context=4096,
        )  # fmt: skip
        target.prefill([3, 4])
        logits = target.forward(torch.tensor([4, 9, 9])).logits  # the last committed token, then two drafts
    accepted, tokens = verify_greedy(torch.tensor([9, 9]), logits)
    assert (int(accepted), int(tokens[0])) == (0, 0)


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (json_reply(500, {"error": "boom"}), "HTTP 500"),
        (json_reply(200, {"choices": [{"index": 0, "token_ids": [1], "prompt_logprobs": [None]}]}), "entries"),
        ((200, {"content-type": "text/plain"}, b"not json"), "scoring call"),
    ],
)
def test_every_scoring_failure_is_a_verification_error(http_stub, reply, why):
    stub = http_stub({("POST", "/v1/completions"): lambda request: reply})
    with httpx.Client() as client, pytest.raises(RemoteVerificationError, match=why):
        score(
            client=client, base_url=stub.base_url, headers={}, wire=wire_for("vllm"), model="m",
            token_ids=[1, 2, 3], top_n=1,
        )  # fmt: skip
