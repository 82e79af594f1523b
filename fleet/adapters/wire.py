"""What a server kind says at request time, as wire format only: build the request, parse the answer.

Each adapter class carries one `ServerWire` (its `wire` class attribute; `fleet.adapters.wire_for(kind)`). The
caller keeps its own transport (the gateway an async httpx client, the worker a sync one): it sends
`request.method` to the endpoint's base URL + `request.path` with `request.json`, and hands the decoded answer
back to the wire, which turns it into plain Python values. What a server kind cannot do raises `Unsupported`
with the reason before anything is sent; an answer of the wrong shape raises `WireError` (a ValueError).

The operations (one pair of build / parse methods each):
    tokenize, detokenize     text or chat messages -> token ids; token ids -> text
    score                    the server's log-probabilities at every position of a token sequence (top-N and
                             the sequence's own token) and its greedy next token
    continuation             generate on from token ids with the given sampling and stop fields (streamed or
                             not), reporting the token ids it produced
    baseline                 a plain greedy generation of N tokens, end of sequence ignored where the server
                             allows it: the caller times it and divides the completion tokens by the time
    spec_counters            the server's cumulative speculative-decoding counters (native path), and
    response_spec_stats      one response's own speculative-decoding metrics
    token_ids_fields, take_token_ids
                             ask a served response to carry its prompt and output token ids (shadow capture),
                             read them back and strip them again
    in_flight                the requests the server is running or queueing (a managed instance drains)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, overload

# Not a server's name: the key under which parse_spec_counters keeps the requests the server was running.
REQUESTS_RUNNING = "ace:requests_running"


class Unsupported(Exception):
    """This server kind cannot do the operation; `reason` says why (it goes into stage records as is)."""

    def __init__(self, kind: str, operation: str, reason: str) -> None:
        super().__init__(f"{operation} is not available for server kind {kind!r}: {reason}")
        self.kind = kind
        self.operation = operation
        self.reason = reason


class WireError(ValueError):
    """The server's answer does not have the shape its kind defines."""


@dataclass(frozen=True)
class WireRequest:
    method: str  # "GET" | "POST"
    path: str  # appended to the endpoint's base URL
    json: dict[str, Any] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int | None = None  # 1 = the most likely token; None where the server does not say


@dataclass(frozen=True)
class PositionScores:
    """The server's log-probabilities at one position of a scored sequence: the distribution that predicted the
    sequence's token at that position."""

    top: tuple[TokenLogprob, ...]  # the server's top-N, most likely first
    token: TokenLogprob | None = None  # the sequence's own token here (also in `top` when it ranks there)

    def rank_of(self, token_id: int) -> int | None:
        if self.token is not None and self.token.token_id == token_id and self.token.rank is not None:
            return self.token.rank
        return next((t.rank for t in self.top if t.token_id == token_id), None)

    def is_argmax(self, token_id: int) -> bool:
        """The server ranks `token_id` first (its own rank where it gives one)."""
        return self.rank_of(token_id) == 1

    def argmax(self) -> int:
        if not self.top:
            raise WireError("no top log-probability at this position (asked for top 0?)")
        return self.top[0].token_id

    def logprobs(self) -> dict[int, float]:
        """Every log-probability the server gave here: the top-N and the sequence's own token."""
        known = {t.token_id: t.logprob for t in self.top}
        if self.token is not None:
            known.setdefault(self.token.token_id, self.token.logprob)
        return known


class LazyPositions(Sequence["PositionScores | None"]):
    """A scored sequence's positions, each read from the server's raw entry on first access: the remote path
    scores the whole context on every step but reads only the drafts' positions, so a long context costs its JSON
    decoding once, not a parse of every position (a malformed entry raises WireError where it is read)."""

    def __init__(self, length: int, parse: Callable[[int], PositionScores | None]) -> None:
        self._length = length
        self._parse = parse
        self._parsed: dict[int, PositionScores | None] = {}

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> PositionScores | None: ...

    @overload
    def __getitem__(self, index: slice) -> list[PositionScores | None]: ...

    def __getitem__(self, index: int | slice) -> PositionScores | None | list[PositionScores | None]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"position {index} of a sequence of {self._length}")
        if index not in self._parsed:
            self._parsed[index] = self._parse(index)
        return self._parsed[index]


@dataclass(frozen=True)
class Scored:
    """A scored sequence: positions[j] predicted token j (positions[0] is None: nothing predicts the first token);
    `generated` holds the token(s) the server generated greedily after the sequence."""

    positions: Sequence[PositionScores | None]
    generated: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Continued:
    """One streamed event (or the whole answer) of a continuation: what it added and whether it finished."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class TokenIdsSeen:
    """The token ids one served response (or streamed event) carried for choice 0."""

    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    found: bool = False  # the payload carried token id fields at all


class ServerWire:
    """The base: every operation refused with the reason in `refusals`; a server kind overrides what it can do."""

    kind: ClassVar[str] = "?"
    refusals: ClassVar[dict[str, str]] = {}
    # The probe's prompt_scoring_method that `score` speaks (None: scoring token ids by id is refused).
    scoring_method: ClassVar[str | None] = None

    def refuse(self, operation: str) -> Unsupported:
        return Unsupported(self.kind, operation, self.refusals.get(operation, "the server kind does not offer it"))

    # --- tokenize / detokenize ----------------------------------------------------------------------------------

    def tokenize(
        self,
        *,
        model: str,
        prompt: str | None = None,
        messages: list[Any] | None = None,
        add_special_tokens: bool | None = None,
    ) -> WireRequest:
        raise self.refuse("tokenize")

    def parse_tokenize(self, body: Any) -> list[int]:
        return as_token_ids(expect_dict(body, "/tokenize").get("tokens"), "/tokenize tokens")

    def detokenize(self, *, model: str, token_ids: list[int]) -> WireRequest:
        raise self.refuse("detokenize")

    def parse_detokenize(self, body: Any) -> str:
        raise self.refuse("detokenize")

    # --- scoring ------------------------------------------------------------------------------------------------

    def score(self, *, model: str, token_ids: list[int], top_n: int | None) -> WireRequest:
        """Score `token_ids` (top_n log-probabilities per position; None: none, only the greedy next token)."""
        raise self.refuse("score")

    def parse_score(self, body: Any, *, token_ids: list[int], top_n: int | None) -> Scored:
        raise self.refuse("score")

    # --- generation ---------------------------------------------------------------------------------------------

    def continuation(
        self, *, model: str, token_ids: list[int], max_tokens: int, fields: dict[str, Any], stream: bool
    ) -> WireRequest:
        """Generate up to max_tokens after `token_ids`; `fields` are sampling / stop fields in the OpenAI request's
        own names (temperature 0: greedy)."""
        raise self.refuse("continuation")

    def parse_continuation(self, payload: Any) -> Continued | None:
        """One answer or streamed event; None when it carries no choice (a usage-only event)."""
        raise self.refuse("continuation")

    def baseline(self, *, model: str, prompt: str | list[int], max_tokens: int) -> WireRequest:
        raise self.refuse("baseline")

    def parse_baseline(self, body: Any) -> int:
        """The number of tokens the baseline generation produced."""
        usage = expect_dict(expect_dict(body, "the baseline answer").get("usage"), "usage")
        tokens = usage.get("completion_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise WireError("usage.completion_tokens is not a token count")
        return tokens

    # --- the server's own speculation ---------------------------------------------------------------------------

    def spec_counters(self) -> WireRequest:
        raise self.refuse("spec_counters")

    def parse_spec_counters(self, text: str) -> dict[str, float]:
        """The counters, and the requests the server was running under REQUESTS_RUNNING."""
        raise self.refuse("spec_counters")

    def spec_stats(self, before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
        """Acceptance over the counters' growth between two scrapes."""
        raise self.refuse("spec_counters")

    def response_spec_stats(self, payload: Any) -> dict[str, Any] | None:
        """A response's own speculative-decoding metrics, or None when it carries none."""
        return None

    # --- load ---------------------------------------------------------------------------------------------------

    def in_flight(self) -> WireRequest:
        raise self.refuse("in_flight")

    def parse_in_flight(self, text: str) -> float:
        """Requests running or waiting, summed over engines (0 when the gauges are absent)."""
        raise self.refuse("in_flight")

    # --- token ids of a served response (shadow) -----------------------------------------------------------------

    def token_ids_fields(self) -> dict[str, Any]:
        """Fields to add to a served request so the response carries its prompt and output token ids."""
        raise self.refuse("token_ids")

    def take_token_ids(self, payload: dict[str, Any], *, strip: bool) -> TokenIdsSeen:
        """Read choice 0's token ids from a response object; strip=True removes them as if never asked for."""
        raise self.refuse("token_ids")


# --- helpers the server kinds share -------------------------------------------------------------------------------


def expect_dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(f"{what} is {type(value).__name__}, expected an object")
    return value


def expect_list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise WireError(f"{what} is {type(value).__name__}, expected a list")
    return value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_token_ids(value: Any, what: str) -> list[int]:
    ids = expect_list(value, what)
    if not all(is_int(t) for t in ids):
        raise WireError(f"{what} is not a list of integer token ids")
    return ids


def sum_gauges(text: str, names: tuple[str, ...]) -> float:
    """The sum of the Prometheus samples of these metric names (every label set)."""
    total = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return total


def first_choice(body: Any, what: str) -> dict[str, Any]:
    choices = expect_list(expect_dict(body, what).get("choices"), f"{what} choices")
    if not choices:
        raise WireError(f"{what} has no choice")
    return expect_dict(choices[0], f"{what} choice")


def ranked_top(entries: list[TokenLogprob], top_n: int | None) -> tuple[TokenLogprob, ...]:
    """The entries within the server's top-N, most likely first (an unranked entry counts as within)."""
    limit = top_n if top_n is not None else 0
    inside = [t for t in entries if t.rank is None or t.rank <= limit]
    return tuple(sorted(inside, key=lambda t: (t.rank if t.rank is not None else 1 << 30, -t.logprob)))


class OpenAICompletionsWithTokenIds(ServerWire):
    """/v1/completions with token-id prompts and `return_token_ids` (vLLM; SGLang since its CompletionRequest grew
    the field): continuation, baseline with `ignore_eos`, and shadow's token id capture."""

    stop_reason_key: ClassVar[str] = "stop_reason"  # where a choice says which stop token / string matched
    stripped_ids_absent: ClassVar[bool] = False  # without the flag the id fields are absent (else null)

    def continuation(
        self, *, model: str, token_ids: list[int], max_tokens: int, fields: dict[str, Any], stream: bool
    ) -> WireRequest:
        body = {"model": model, "prompt": list(token_ids), "max_tokens": max_tokens, **fields, "stream": stream}
        return WireRequest("POST", "/v1/completions", {**body, "return_token_ids": True})

    def parse_continuation(self, payload: Any) -> Continued | None:
        choices = expect_dict(payload, "a completion").get("choices")
        if not choices:
            return None
        choice = expect_dict(expect_list(choices, "choices")[0], "a choice")
        text = choice.get("text")
        return Continued(
            token_ids=as_token_ids(choice.get("token_ids") or [], "token_ids"),
            text=text if isinstance(text, str) else "",
            finish_reason=choice.get("finish_reason") or None,
            stop_reason=choice.get(self.stop_reason_key),
        )

    def baseline(self, *, model: str, prompt: str | list[int], max_tokens: int) -> WireRequest:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return WireRequest("POST", "/v1/completions", body)

    def token_ids_fields(self) -> dict[str, Any]:
        return {"return_token_ids": True}

    def take_token_ids(self, payload: dict[str, Any], *, strip: bool) -> TokenIdsSeen:
        seen = TokenIdsSeen()
        if payload.get("prompt_token_ids") is not None:  # chat: at the top level
            seen.prompt_ids = as_token_ids(payload["prompt_token_ids"], "prompt_token_ids")
            seen.found = True
            if strip:
                self._strip(payload, "prompt_token_ids")
        for choice in payload.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if choice.get("prompt_token_ids") is not None:
                seen.prompt_ids = as_token_ids(choice["prompt_token_ids"], "prompt_token_ids")
            if choice.get("token_ids") is not None:
                seen.output_ids.extend(as_token_ids(choice["token_ids"], "token_ids"))
            if choice.get("finish_reason"):
                seen.finish_reason = choice["finish_reason"]
            for key in ("token_ids", "prompt_token_ids"):
                if choice.get(key) is not None:
                    seen.found = True
                    if strip:
                        self._strip(choice, key)
        return seen

    def _strip(self, holder: dict[str, Any], key: str) -> None:
        if self.stripped_ids_absent:
            del holder[key]
        else:
            holder[key] = None
