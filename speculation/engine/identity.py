"""Is a local checkpoint the model a server serves? Compare it with the server's own answers on one sequence.

The reference is what the server answered (fleet's probe records it): a prompt's token ids followed by the server's
greedy continuation, and, where the server returns them, its top log-probabilities at every position of that
sequence. The local model scores the same sequence teacher-forced (one forward pass; each position sees the server's
tokens before it, so one early difference does not cascade) and must agree:

- greedy: at each continuation position the server's token is the local argmax, or within GREEDY_TIE_NATS of it (a
  tie the two implementations may break differently);
- log-probabilities: every token of the server's top-N is within LOGPROB_TOLERANCE_NATS of the local value.

Tolerance, from measurement on the demo pair (demo-v10; the canary is 62 tokens, 16 continued, top 5 at each of
the 77 positions): ACE's engine against the vLLM (CPU, float32) serving the same files differs by at most 1.1e-5
nats; the same checkpoint run at float16 by 0.011 and at bfloat16 by 0.10 nats (what a server in half precision
would show against this float32 engine); weights with 0.1 % noise by 0.038, with 1 % noise by 0.39, with 5 % by 1.07;
the demo draft (same tokenizer) by 7.5 nats, and its greedy continuation differs at the second token (1.1 nats below
its own choice). 0.25 nats passes a half-precision server of the same files with more than twice its largest
difference and refuses every different checkpoint measured, a 1 % perturbation included. The greedy continuation's
margins between the target's top two tokens were 0.11 to 4.5 nats: a tie within the same 0.25 nats is taken for one
the two implementations may break differently.

Run as ``python -m speculation.engine.identity`` it reads {"directory", "reference"} as JSON on stdin and writes the
verdict as JSON: the check for a process that must not import torch itself (the web process).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from speculation.engine.model import Transformer

LOGPROB_TOLERANCE_NATS = 0.25
GREEDY_TIE_NATS = 0.25


@dataclass(frozen=True)
class Reference:
    """The server's answers: token_ids = the prompt (prompt_len tokens) + its greedy continuation; top[j] = the
    server's top log-probabilities {token id: logprob} of the distribution that predicted token j (None for j = 0, or
    where the server returned none); top is None where the server returns no log-probabilities at all."""

    token_ids: list[int]
    prompt_len: int
    top: list[dict[int, float] | None] | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Reference:
        """The recorded form: {"token_ids", "prompt_len", "top_logprobs": [null | [[id, logprob], ...]] | null}."""
        ids = [int(t) for t in data["token_ids"]]
        prompt_len = int(data["prompt_len"])
        if not 0 < prompt_len <= len(ids):
            raise ValueError(f"prompt_len {prompt_len} does not fit {len(ids)} token ids")
        raw = data.get("top_logprobs")
        top = None
        if raw is not None:
            if len(raw) != len(ids):
                raise ValueError(f"top_logprobs has {len(raw)} positions for {len(ids)} token ids")
            top = [None if p is None else {int(t): float(lp) for t, lp in p} for p in raw]
        if prompt_len == len(ids) and not any(top or ()):
            raise ValueError("the reference holds neither a continuation nor log-probabilities: nothing to compare")
        return cls(ids, prompt_len, top)

    @property
    def continuation(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


@dataclass(frozen=True)
class Mismatch:
    """Where the local model first disagreed. kind "greedy": continuation token `index` (0-based) is `server_token`
    on the server and `local_token` here, `nats` below the local argmax; kind "logprobs": the largest difference,
    `nats`, at sequence position `index` for `server_token` (local_token: the local argmax there)."""

    kind: str
    index: int
    server_token: int
    local_token: int
    nats: float


@dataclass(frozen=True)
class Verdict:
    mismatch: Mismatch | None
    max_logprob_diff: float | None  # None: the reference has no log-probabilities (greedy alone was compared)
    compared_tokens: int  # continuation tokens compared
    tolerance_nats: float = LOGPROB_TOLERANCE_NATS

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "mismatch": asdict(self.mismatch) if self.mismatch else None}


@torch.inference_mode()
def local_logprobs(model: Transformer, token_ids: list[int]) -> torch.Tensor:
    """log p(. | token_ids[:j]) for j = 1..T-1, teacher-forced in one pass: [T - 1, V] (row j - 1 predicts token j)."""
    if len(token_ids) > model.max_len:
        model.setup_cache(len(token_ids))
    tokens = torch.tensor(token_ids[:-1], device=model.output.weight.device)
    logits = model(tokens, 0).logits  # [T - 1, V]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def compare(reference: Reference, logprobs: torch.Tensor) -> Verdict:
    """The verdict on local log-probabilities [T - 1, V] (local_logprobs) against the server's reference."""
    vocab = logprobs.shape[-1]
    if max(reference.token_ids) >= vocab:
        token = max(reference.token_ids)
        return Verdict(Mismatch("vocab", 0, token, -1, math.inf), None, 0)
    argmax = logprobs.argmax(dim=-1)  # [T - 1]
    for i, token in enumerate(reference.continuation):
        row = reference.prompt_len + i - 1
        best = int(argmax[row])
        below = float(logprobs[row, best] - logprobs[row, token])
        if best != token and below > GREEDY_TIE_NATS:
            return Verdict(Mismatch("greedy", i, token, best, below), None, i)
    compared = len(reference.continuation)
    if reference.top is None:
        return Verdict(None, None, compared)
    worst: Mismatch | None = None
    for j, top in enumerate(reference.top):
        if not j or not top:
            continue
        for token, server_lp in top.items():
            local_lp = float(logprobs[j - 1, token]) if token < vocab else -math.inf
            diff = abs(local_lp - server_lp)
            if worst is None or diff > worst.nats:
                worst = Mismatch("logprobs", j, token, int(argmax[j - 1]), diff)
    if worst is None:
        return Verdict(None, None, compared)
    return Verdict(worst if worst.nats > LOGPROB_TOLERANCE_NATS else None, worst.nats, compared)


def check_directory(directory: str | Path, reference: Reference) -> Verdict:
    """Load the checkpoint in `directory` (the engine's loader, float32, the cache only as long as the sequence)
    and compare it with the reference."""
    from speculation.engine.loader import load_causal_lm

    model = load_causal_lm(directory, dtype=torch.float32, max_len=len(reference.token_ids))
    return compare(reference, local_logprobs(model, reference.token_ids))


def main() -> int:
    request = json.loads(sys.stdin.read())
    try:
        verdict = check_directory(request["directory"], Reference.from_json(request["reference"]))
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        json.dump({"error": f"{type(exc).__name__}: {exc}"}, sys.stdout)
        return 0
    json.dump(verdict.as_json(), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
