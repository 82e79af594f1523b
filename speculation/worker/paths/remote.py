"""Remote path: the draft runs in the GPU worker; the target verifies through its own API.

One scoring call per step, in the endpoint kind's wire format (fleet.adapters.wire: vLLM's `prompt_logprobs`
on /v1/completions, SGLang's /generate with `return_logprob`): the sequence is the committed token ids followed
by the K drafts; the top-1 log-probabilities give, at every draft position, the target's rank of the draft
token and its argmax, and one greedy token is generated after the last draft: the bonus token when every
draft is accepted. Exact at temperature 0 (argmax check).

Sampled requests with 0 < top_k < N (the server's max logprobs) run the engine's own loop on
RemoteTopKTarget: the target's processed distribution is then fully known from its top-N log-probabilities.
"""

from __future__ import annotations

import logging

import httpx

from fleet.adapters import PositionScores, Scored, ServerWire

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


class RemoteGreedyVerifier:
    def __init__(
        self, *, client: httpx.Client, base_url: str, model: str, headers: dict[str, str], wire: ServerWire
    ) -> None:
        self.client = client
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = headers
        self.wire = wire

    def verify(self, context: list[int], drafts: list[int]) -> tuple[int, int]:
        scored = score(
            client=self.client,
            base_url=self.base_url,
            headers=self.headers,
            wire=self.wire,
            model=self.model,
            token_ids=context + drafts,
            top_n=1 if drafts else None,
        )
        generated = scored.generated
        if not drafts:
            if not generated:
                raise RemoteVerificationError("the target returned no token")
            return 0, int(generated[0])
        for i, draft in enumerate(drafts):
            position = scored.positions[len(context) + i]
            if position is None:  # only the first token of a sequence has none, and the context is not empty
                raise RemoteVerificationError(f"no log-probabilities at draft position {i}")
            if not position.is_argmax(draft):
                return i, position.argmax()
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
        wire: ServerWire,
        vocab_size: int,
        max_context: int,
        top_k: int,
        top_n: int,
    ) -> None:
        import torch

        if not 0 < top_k < top_n:
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

    def prefill(self, prompt_ids: list[int]) -> None:
        self.tokens = list(prompt_ids[:-1])

    def forward(self, tokens, *, return_hidden: bool = False):
        import torch

        from speculation.engine.target import TargetOutput

        new = [int(t) for t in tokens.tolist()]
        start = len(self.tokens)
        prompt = self.tokens + new
        scored = score(
            client=self.client,
            base_url=self.base_url,
            headers=self.headers,
            wire=self.wire,
            model=self.model,
            token_ids=[*prompt, PLACEHOLDER_TOKEN],
            top_n=self.top_n,
        )
        logits = torch.full((len(new), self.vocab_size), float("-inf"))  # [T, V]
        for row, position in enumerate(scored.positions[start + 1 :]):
            if position is None:
                raise RemoteVerificationError("no log-probabilities after a committed token")
            self._fill(logits[row], position)
        self.tokens = prompt
        return TargetOutput(logits=logits, hidden=None)

    def _fill(self, row, position: PositionScores) -> None:
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


PLACEHOLDER_TOKEN = 0  # scored only for the entry before it; its own log-probability is never used
