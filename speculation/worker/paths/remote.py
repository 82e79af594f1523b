"""Remote path: the draft runs in the GPU worker; the target verifies through its own API.

One vLLM `/v1/completions` call per step: the prompt is the committed token ids followed by the K drafts,
`prompt_logprobs: 1` gives, at every draft position, the target's rank of the draft token and its argmax,
and `max_tokens: 1` at temperature 0 generates the target's next token after the last draft: the bonus
token when every draft is accepted. Exact at temperature 0 (argmax check).

Sampled requests with 0 < top_k < N (the server's max logprobs) run the engine's own loop on
RemoteTopKTarget: the target's processed distribution is then fully known from its top-N log-probabilities.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

logger = logging.getLogger(__name__)

VERIFY_TIMEOUT = httpx.Timeout(connect=5.0, read=120.0, write=30.0, pool=30.0)


class RemoteVerificationError(RuntimeError):
    pass


def _argmax(entry: dict[str, Any]) -> int:
    """The rank-1 token of one prompt_logprobs entry ({token id as str: {"logprob", "rank", ...}})."""
    best = min(entry.items(), key=lambda item: (item[1].get("rank") or 1 << 30, -item[1]["logprob"]))
    return int(best[0])


class RemoteGreedyVerifier:
    def __init__(self, *, client: httpx.Client, base_url: str, model: str, headers: dict[str, str]) -> None:
        self.client = client
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.headers = headers

    def verify(self, context: list[int], drafts: list[int]) -> tuple[int, int]:
        payload = {
            "model": self.model,
            "prompt": context + drafts,
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": 1 if drafts else None,
            "return_token_ids": True,
            "ignore_eos": False,
        }
        try:
            response = self.client.post(self.url, json=payload, headers=self.headers, timeout=VERIFY_TIMEOUT)
        except httpx.HTTPError as exc:
            raise RemoteVerificationError(f"target scoring call failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise RemoteVerificationError(f"target scoring call: HTTP {response.status_code}: {response.text[:200]}")
        choice = response.json()["choices"][0]
        generated = choice.get("token_ids") or []
        if not drafts:
            if not generated:
                raise RemoteVerificationError("the target returned no token")
            return 0, int(generated[0])
        scores = choice.get("prompt_logprobs") or []
        if len(scores) != len(context) + len(drafts):
            raise RemoteVerificationError(
                f"prompt_logprobs has {len(scores)} entries, expected {len(context) + len(drafts)}"
            )
        for i, draft in enumerate(drafts):
            entry = scores[len(context) + i]
            mine = entry.get(str(draft))
            if mine is None or mine.get("rank") != 1:
                return i, _argmax(entry)
        if not generated:
            # Finished right after the drafts without generating (cannot happen with max_tokens 1 and a budget).
            raise RemoteVerificationError("the target generated no bonus token")
        return len(drafts), int(generated[0])


class RemoteTopKTarget:
    """The engine's Target protocol over the server's scoring API, for sampled requests with top-k < N.

    forward() sends the committed tokens, the new ones and one placeholder token as a prompt with
    ``prompt_logprobs: N``: entry j + 1 holds the target's top-N log-probabilities after token j, so the last
    (placeholder) entry gives the distribution after the last new token. Returned "logits" are those raw
    log-probabilities with -inf outside the top N. After temperature and top-k (k < N) the support is the true
    top-k, all of them returned, and softmax over them equals the processed distribution; top-p then acts on
    that as in vLLM. Exact for 0 < top_k < N; the caller (gateway.sampling.path_reason) guarantees it.
    """

    def __init__(
        self,
        *,
        client: httpx.Client,
        base_url: str,
        model: str,
        headers: dict[str, str],
        vocab_size: int,
        max_context: int,
        top_k: int,
        top_n: int,
    ) -> None:
        import torch

        if not 0 < top_k < top_n:
            raise RemoteVerificationError(f"top_k {top_k} must be in (0, {top_n}) for remote sampled verification")
        self.client = client
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.headers = headers
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.top_k, self.top_n = top_k, top_n
        self.device = torch.device("cpu")
        self.tokens: list[int] = []

    def prefill(self, prompt_ids: list[int]) -> None:
        self.tokens = list(prompt_ids[:-1])

    def forward(self, tokens, *, return_hidden: bool = False):
        import torch

        from speculation.engine.target import TargetOutput

        new = [int(t) for t in tokens.tolist()]
        start = len(self.tokens)
        prompt = self.tokens + new
        payload = {
            "model": self.model,
            "prompt": [*prompt, PLACEHOLDER_TOKEN],
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": self.top_n,
        }
        try:
            response = self.client.post(self.url, json=payload, headers=self.headers, timeout=VERIFY_TIMEOUT)
        except httpx.HTTPError as exc:
            raise RemoteVerificationError(f"target scoring call failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise RemoteVerificationError(f"target scoring call: HTTP {response.status_code}: {response.text[:200]}")
        scores = response.json()["choices"][0].get("prompt_logprobs") or []
        if len(scores) != len(prompt) + 1:
            raise RemoteVerificationError(f"prompt_logprobs has {len(scores)} entries, expected {len(prompt) + 1}")
        logits = torch.full((len(new), self.vocab_size), float("-inf"))  # [T, V]
        for row, entry in enumerate(scores[start + 1 :]):
            self._fill(logits[row], entry)
        self.tokens = prompt
        return TargetOutput(logits=logits, hidden=None)

    def _fill(self, row, entry: dict[str, Any]) -> None:
        ranked = sorted((int(v.get("rank") or 1 << 30), int(t), float(v["logprob"])) for t, v in entry.items())
        top = [(token, logprob) for rank, token, logprob in ranked if rank <= self.top_n]
        if len(top) < self.top_k + 1:
            raise RemoteVerificationError(
                f"the server returned {len(top)} top log-probabilities, need {self.top_k + 1}"
            )
        if top[self.top_k][1] >= top[self.top_k - 1][1]:
            raise RemoteVerificationError("a tie at the top-k cut: the processed distribution is not known exactly")
        for _, token, logprob in ranked:  # top-N and the prompt's own token: all true values
            if token >= self.vocab_size:
                raise RemoteVerificationError(f"the server returned token {token} outside the vocabulary")
            row[token] = logprob

    def rollback(self, length: int) -> None:
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot roll back to {length}: {len(self.tokens)} positions are cached")
        del self.tokens[length:]


PLACEHOLDER_TOKEN = 0  # scored only for the entry before it; its own log-probability is never used
