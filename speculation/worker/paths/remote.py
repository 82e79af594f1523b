"""Remote path: the draft runs in the GPU worker; the target verifies through its own scoring API.

``RemoteTarget`` is the engine's Target protocol over the server, so the remote path runs the engine's one
decode loop (speculation.engine.decode.generate) like the local path. Each step is one scoring call
(``score``: the endpoint kind's wire format, fleet.adapters.wire: vLLM's `prompt_logprobs` on /v1/completions,
SGLang's /generate with `return_logprob`) whose sequence is the committed tokens followed by the K drafts:

- greedy (top_n 0): the top-1 log-probabilities give, at every draft position, the target's rank of the draft
  token and its argmax, and one greedy token is generated after the last draft (the bonus token when every
  draft is accepted). Each returned "logits" row is one-hot at the target's token, so the loop's greedy
  verification (speculation.engine.verify) accepts exactly the drafts the server ranks first.
- sampled with 0 < top_k < N (the server's max logprobs): one placeholder token is appended and the top-N
  log-probabilities asked for, so the entry after token j holds the target's top-N after it; the rows are those
  raw log-probabilities with -inf outside the top N. After temperature and top-k (k < N) the support is the true
  top-k, all of them returned, and softmax over them equals the processed distribution; top-p then acts on that
  as in vLLM. Exact for 0 < top_k < N; the caller (gateway.sampling.path_reason) guarantees it.
"""

from __future__ import annotations

import logging

import httpx
import torch
from torch import Tensor

from fleet.adapters import PositionScores, Scored, ServerWire
from speculation.engine.target import TargetOutput

logger = logging.getLogger(__name__)

VERIFY_TIMEOUT = httpx.Timeout(connect=5.0, read=120.0, write=30.0, pool=30.0)


class RemoteVerificationError(RuntimeError):
    pass


def score(
    *,
    client: httpx.Client,
    base_url: str,
    headers: dict[str, str],
    wire: ServerWire,
    model: str,
    token_ids: list[int],
    top_n: int | None,
) -> Scored:
    """One scoring call: the target's top_n log-probabilities at every position of `token_ids` (None: none) and
    its greedy next token. Every failure is a RemoteVerificationError."""
    request = wire.score(model=model, token_ids=token_ids, top_n=top_n)
    url = base_url.rstrip("/") + request.path
    try:
        response = client.request(request.method, url, json=request.json, headers=headers, timeout=VERIFY_TIMEOUT)
    except httpx.HTTPError as exc:
        raise RemoteVerificationError(f"target scoring call failed: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise RemoteVerificationError(f"target scoring call: HTTP {response.status_code}: {response.text[:200]}")
    try:
        return wire.parse_score(response.json(), token_ids=token_ids, top_n=top_n)
    except ValueError as exc:  # fleet.adapters.WireError, or an answer that is not JSON
        raise RemoteVerificationError(f"target scoring call: {exc}") from exc


class RemoteTarget:
    """The engine's Target over an endpoint's scoring call.

    Keeps the tokens the server has "processed" (the committed ones but the last); every forward sends them all
    again (the scoring API keeps no cache ACE could hold). top_k / top_n: 0 for greedy requests; for sampled
    ones the request's top_k and the server's max logprobs (0 < top_k < top_n, see ``sampled``).
    """

    def __init__(
        self,
        *,
        client: httpx.Client,
        base_url: str,
        model: str,
        headers: dict[str, str],
        wire: ServerWire,
        vocab_size: int,
        max_context: int,
        top_k: int = 0,
        top_n: int = 0,
    ) -> None:
        if (top_k or top_n) and not 0 < top_k < top_n:
            raise RemoteVerificationError(f"top_k {top_k} must be in (0, {top_n}) for remote sampled verification")
        self.client = client
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = headers
        self.wire = wire
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.top_k, self.top_n = top_k, top_n
        self.device = torch.device("cpu")
        self.tokens: list[int] = []

    def sampled(self, top_k: int, top_n: int) -> RemoteTarget:
        """The same server for a sampled request (0 < top_k < top_n)."""
        return RemoteTarget(
            client=self.client,
            base_url=self.base_url,
            model=self.model,
            headers=self.headers,
            wire=self.wire,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            top_k=top_k,
            top_n=top_n,
        )

    def prefill(self, prompt_ids: list[int]) -> None:
        self.tokens = list(prompt_ids[:-1])

    def forward(self, tokens: Tensor, *, return_hidden: bool = False) -> TargetOutput:
        new = [int(t) for t in tokens.tolist()]
        start = len(self.tokens)
        sequence = self.tokens + new
        logits = torch.full((len(new), self.vocab_size), float("-inf"))  # [T, V]
        if self.top_n:
            scored = self._score([*sequence, PLACEHOLDER_TOKEN], self.top_n)
            for row, position in enumerate(scored.positions[start + 1 :]):
                self._fill(logits[row], _known(position))
        else:
            scored = self._score(sequence, 1 if len(new) > 1 else None)
            for row in range(len(new) - 1):  # row j predicts the token after new[j]: the draft new[j + 1]
                position = _known(scored.positions[start + 1 + row])
                draft = new[row + 1]
                self._one_hot(logits[row], draft if position.is_argmax(draft) else position.argmax())
            if not scored.generated:
                raise RemoteVerificationError("the target generated no token")
            self._one_hot(logits[-1], int(scored.generated[0]))
        self.tokens = sequence
        return TargetOutput(logits=logits, hidden=None)

    def _score(self, token_ids: list[int], top_n: int | None) -> Scored:
        """The one call to the server (see ``score``)."""
        return score(
            client=self.client,
            base_url=self.base_url,
            headers=self.headers,
            wire=self.wire,
            model=self.model,
            token_ids=token_ids,
            top_n=top_n,
        )

    def _one_hot(self, row: Tensor, token: int) -> None:
        if not 0 <= token < self.vocab_size:
            raise RemoteVerificationError(f"the server returned token {token} outside the vocabulary")
        row[token] = 0.0

    def _fill(self, row: Tensor, position: PositionScores) -> None:
        top = position.top
        if len(top) < self.top_k + 1:
            raise RemoteVerificationError(
                f"the server returned {len(top)} top log-probabilities, need {self.top_k + 1}"
            )
        if top[self.top_k].logprob >= top[self.top_k - 1].logprob:
            raise RemoteVerificationError("a tie at the top-k cut: the processed distribution is not known exactly")
        for token, logprob in position.logprobs().items():  # top-N and the prompt's own token: all true values
            if token >= self.vocab_size:
                raise RemoteVerificationError(f"the server returned token {token} outside the vocabulary")
            row[token] = logprob

    def rollback(self, length: int) -> None:
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot roll back to {length}: {len(self.tokens)} positions are cached")
        del self.tokens[length:]


def _known(position: PositionScores | None) -> PositionScores:
    if position is None:  # only the first token of a sequence has none, and the committed tokens are not empty
        raise RemoteVerificationError("no log-probabilities after a committed token")
    return position


PLACEHOLDER_TOKEN = 0  # scored only for the entry before it; its own log-probability is never used
