"""Remote path: the draft runs in the GPU worker; the target verifies through its own API.

One vLLM `/v1/completions` call per step: the prompt is the committed token ids followed by the K drafts,
`prompt_logprobs: 1` gives, at every draft position, the target's rank of the draft token and its argmax,
and `max_tokens: 1` at temperature 0 generates the target's next token after the last draft: the bonus
token when every draft is accepted. Exact at temperature 0 (argmax check), the only case prod serves here.
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
