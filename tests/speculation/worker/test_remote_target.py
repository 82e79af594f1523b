"""The remote path is the engine's one loop on a RemoteTarget (the server's scoring call).

Against a stand-in server answering vLLM's scoring call (prompt_logprobs entries, max_tokens 1 at temperature 0)
from a table "model" (the next token's logits are a fixed function of the last two tokens: exact, no float
ties), greedy speculation is token-identical to plain greedy decoding, stops at the same end token, and the
shadow replay (ReplayTarget) counts exactly what the remote run did.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch

from fleet.adapters import wire_for
from speculation.engine import (
    GenerationConfig,
    NgramProposer,
    Proposal,
    generate,
    generate_plain,
    replay_greedy,
)
from speculation.worker.paths.remote import RemoteTarget, RemoteVerificationError

VOCAB, EOS = 10, 0


class TableModel:
    """Logits [V] after a context: a seeded random vector per (second-last, last) token pair."""

    def __init__(self, seed: int, *, eos_bias: float = -1.5) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.randn(VOCAB, VOCAB, VOCAB, generator=generator, dtype=torch.float64)
        self.table[:, :, EOS] += eos_bias  # ends now and then, not at once

    def logits(self, context: list[int]) -> torch.Tensor:
        a = context[-2] if len(context) > 1 else context[-1]
        return self.table[a, context[-1]]

    def next(self, context: list[int]) -> int:
        return int(self.logits(context).argmax())

    def disagree(self, rate: float, seed: int) -> TableModel:
        """A draft: the same table with a fraction of its rows replaced."""
        rng = random.Random(seed)
        draft = TableModel(0)
        draft.table = self.table.clone()
        for a in range(VOCAB):
            for b in range(VOCAB):
                if rng.random() < rate:
                    draft.table[a, b] = draft.table[a, b][torch.randperm(VOCAB)]
        return draft


class FakeScoringServer:
    """vLLM 0.32's /v1/completions for scoring: prompt_logprobs[0] is None; entry j holds the top-N tokens by
    rank and token j's own; token_ids: the argmax after the whole prompt."""

    def __init__(self, model: TableModel) -> None:
        self.model = model
        self.calls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        body = json.loads(request.content)
        prompt, top_n = body["prompt"], body["prompt_logprobs"]
        entries: list[dict | None] = [None]
        for j in range(1, len(prompt)):
            logprobs = torch.log_softmax(self.model.logits(prompt[:j]), -1)
            order = logprobs.argsort(descending=True).tolist()
            shown = set(order[: top_n or 0]) | {prompt[j]}
            entries.append({str(t): {"logprob": float(logprobs[t]), "rank": order.index(t) + 1} for t in shown})
        choice = {"index": 0, "prompt_logprobs": entries if top_n else None, "token_ids": [self.model.next(prompt)]}
        return httpx.Response(200, json={"choices": [choice]})


class TableProposer:
    """An engine proposer drafting greedily from a table model."""

    wants_hidden = False

    def __init__(self, model: TableModel) -> None:
        self.model = model

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, committed, k, params, generator) -> Proposal:
        drafts: list[int] = []
        for _ in range(k):
            drafts.append(self.model.next(committed + drafts))
        return Proposal(tokens=torch.tensor(drafts, dtype=torch.long), q=None)

    def on_verified(self, num_accepted: int, num_drafted: int) -> None:
        pass

    def observe_target(self, hidden, num_accepted: int) -> None:
        pass


def remote_target(server: FakeScoringServer, *, status: int = 200) -> RemoteTarget:
    transport = httpx.MockTransport(server if status == 200 else lambda request: httpx.Response(status, text="down"))
    return RemoteTarget(
        client=httpx.Client(transport=transport), base_url="http://fake", model="m", headers={},
        wire=wire_for("vllm"), vocab_size=VOCAB, max_context=4096,
    )  # fmt: skip


def plain_greedy(model: TableModel, prompt: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(model.next(prompt + out))
        if out[-1] == EOS:
            break
    return out


@pytest.mark.parametrize("seed", range(30))
def test_remote_speculation_is_greedy_exact_and_the_replay_counts_what_it_did(seed):
    # given: a target behind the scoring API, and a draft agreeing with it on about 70% of contexts
    rng = random.Random(seed)
    target_model = TableModel(seed)
    draft_model = target_model.disagree(0.3, seed)
    prompt = [rng.randint(1, VOCAB - 1) for _ in range(rng.randint(2, 6))]
    max_tokens, k = rng.randint(1, 40), rng.randint(1, 6)
    config = GenerationConfig(max_new_tokens=max_tokens, k=k, stop_token_ids=(EOS,))
    server = FakeScoringServer(target_model)
    # when
    result = generate(remote_target(server), TableProposer(draft_model), prompt, config)
    # then: plain greedy's tokens, one scoring call per verification step
    assert result.tokens == plain_greedy(target_model, prompt, max_tokens)
    assert server.calls == result.stats.target_passes
    # and the shadow replay of that output, from the draft's teacher-forced predictions, counts the same
    sequence = prompt + result.tokens
    predictions = [draft_model.next(sequence[: i + 1]) for i in range(len(sequence))]
    replayed = replay_greedy(predictions, sequence, k, prompt_len=len(prompt), max_new_tokens=max_tokens)
    assert replayed.counts() == result.stats.counts()


def test_remote_plain_decoding_and_ngram_drafts_give_the_same_tokens():
    model = TableModel(7, eos_bias=-50.0)  # never ends: the length limit does
    prompt = [3, 4, 3, 4, 3, 4]
    plain = generate_plain(remote_target(FakeScoringServer(model)), prompt, GenerationConfig(max_new_tokens=30))
    spec = generate(remote_target(FakeScoringServer(model)), NgramProposer(), prompt, GenerationConfig(30, k=4))
    assert plain.tokens == spec.tokens == plain_greedy(model, prompt, 30)
    assert plain.stats.drafted_tokens == 0 and plain.stats.target_passes == 30


def test_a_failing_scoring_call_raises_for_the_fallback():
    target = remote_target(FakeScoringServer(TableModel(0)), status=503)
    with pytest.raises(RemoteVerificationError, match="HTTP 503"):
        generate(target, NgramProposer(), [1, 2, 1, 2], GenerationConfig(max_new_tokens=4, k=2))
