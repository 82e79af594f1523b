"""Suffix decoding: draft from what the target answered before (SuffixDecoding, Oliaro et al. 2024; vLLM's
``method: "suffix"`` through Arctic Inference).

Prompt lookup (``NgramProposer``) copies from the request's own context. Suffix decoding also looks in a store of
earlier responses: where the last tokens of the context occurred before, in this request or in a cached answer,
the continuation the target wrote most often after them is the draft. Workloads whose answers repeat (agents,
templated extraction, a model that quotes the same passages) accept long drafts; elsewhere it finds nothing and
costs nearly nothing (a dictionary lookup per step, no model).

``SuffixIndex`` is the store: sequences of token ids (the earlier responses) under a key each, the oldest dropped
past ``max_sequences``, indexed by their n-grams of length 1..``max_match`` (a bounded number of latest positions
per n-gram). ``SuffixProposer`` drafts from an index and the request's own context:

1. the longest suffix of the context (up to ``max_match`` tokens) that occurs in the index or earlier in the
   context; no match, no draft. Its occurrences are then compared further back (up to ``MAX_DEPTH`` tokens, as
   SuffixDecoding's tree depth) and only those matching the longest stretch are kept: two places that share the
   last few tokens but not what came before them do not vote against each other;
2. from the occurrences kept, token by token: the continuation most of them agree on (ties: the latest
   occurrence), keeping only the occurrences that agree, and stopping where the winner's share is under
   ``min_token_prob`` (SuffixDecoding's frequency cut), at ``max_spec_factor`` x the match length, or at k.

Drafts are one-hot (no draft distribution), so the engine's verification is exact for greedy and for sampled
requests, as for prompt lookup. ``exclude`` leaves one stored key out of the lookup: a replay of a request whose
own answer is already in the store must not draft from it.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable

import torch
from torch import Tensor

from speculation.engine.proposers import Proposal
from speculation.engine.sampling import SamplingParams

MAX_MATCH = 6  # the longest suffix looked up in the index (tokens)
MAX_DEPTH = 32  # how far back the occurrences found are compared with the context
MAX_OCCURRENCES = 32  # latest positions kept per n-gram (and voted over)
MIN_TOKEN_PROB = 0.1  # SuffixDecoding's default: stop where the best continuation has less support
MAX_SPEC_FACTOR = 2.0  # at most this x the match length drafted (SuffixDecoding's spec factor)


class SuffixIndex:
    """Earlier responses, looked up by their n-grams. Thread-safe: the worker's batch loop reads it while a
    request's completion adds to it."""

    def __init__(self, *, max_sequences: int = 2000, max_match: int = MAX_MATCH):
        if max_sequences < 1 or max_match < 1:
            raise ValueError("max_sequences and max_match must be >= 1")
        self.max_sequences, self.max_match = max_sequences, max_match
        self._sequences: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._ids: dict[str, int] = {}  # key -> a serial number (positions name it, so an evicted key is stale)
        self._serial = 0
        self._positions: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> [(serial, end)], latest last
        self._by_serial: dict[int, tuple[int, ...]] = {}
        self._serial_key: dict[int, str] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sequences)

    def __contains__(self, key: str) -> bool:
        return key in self._sequences

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self._sequences.values())

    def add(self, key: str, tokens: Iterable[int]) -> None:
        """Store a response under key (a key already stored is left as it is)."""
        sequence = tuple(int(t) for t in tokens)
        with self._lock:
            if key in self._sequences or len(sequence) < 2:
                return
            self._serial += 1
            serial = self._serial
            self._sequences[key] = sequence
            self._ids[key] = serial
            self._by_serial[serial] = sequence
            self._serial_key[serial] = key
            for end in range(1, len(sequence)):  # the n-grams ending at end - 1, continued by sequence[end]
                for n in range(1, min(self.max_match, end) + 1):
                    slot = self._positions.setdefault(sequence[end - n : end], [])
                    slot.append((serial, end))
                    if len(slot) > MAX_OCCURRENCES:
                        del slot[0]
            while len(self._sequences) > self.max_sequences:
                old, _ = self._sequences.popitem(last=False)
                gone = self._ids.pop(old)
                del self._by_serial[gone], self._serial_key[gone]
                # positions naming a gone serial are skipped at lookup and age out of their bounded lists

    def occurrences(self, suffix: tuple[int, ...], exclude: str = "") -> list[tuple[tuple[int, ...], int]]:
        """(sequence, position after the suffix) for the stored occurrences of suffix, latest last."""
        with self._lock:
            found = []
            for serial, end in self._positions.get(suffix, ()):
                sequence = self._by_serial.get(serial)
                if sequence is not None and self._serial_key[serial] != exclude:
                    found.append((sequence, end))
            return found


def _match_len(sequence: tuple[int, ...], at: int, committed: list[int]) -> int:
    """How many tokens before sequence[at] equal the context's last ones (up to MAX_DEPTH)."""
    n_tokens, length = len(committed), 0
    while length < MAX_DEPTH and length < at and length < n_tokens:
        if sequence[at - length - 1] != committed[n_tokens - length - 1]:
            break
        length += 1
    return length


class SuffixProposer:
    """Drafts the most frequent earlier continuation of the context's longest matching suffix (see the module)."""

    wants_hidden = False

    def __init__(
        self,
        index: SuffixIndex | None = None,
        *,
        exclude: str = "",
        max_match: int = MAX_MATCH,
        min_token_prob: float = MIN_TOKEN_PROB,
        max_spec_factor: float = MAX_SPEC_FACTOR,
    ):
        if max_match < 1:
            raise ValueError("max_match must be >= 1")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError("min_token_prob must be in [0, 1]")
        if max_spec_factor <= 0:
            raise ValueError("max_spec_factor must be > 0")
        self.index = index if index is not None else SuffixIndex(max_match=max_match)
        self.exclude = exclude
        self.max_match = min(max_match, self.index.max_match)
        self.min_token_prob, self.max_spec_factor = min_token_prob, max_spec_factor
        self.device = torch.device("cpu")

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(
        self, committed: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        return Proposal(tokens=torch.tensor(self.lookup(committed, k), dtype=torch.long, device=self.device), q=None)

    def lookup(self, committed: list[int], k: int) -> list[int]:
        """Up to k draft tokens to follow committed (the batch loop calls this directly, as NgramProposer's)."""
        n_tokens = len(committed)
        if k <= 0 or n_tokens == 0:
            return []
        for n in range(min(self.max_match, n_tokens), 0, -1):
            suffix = tuple(committed[n_tokens - n :])
            found = self.index.occurrences(suffix, self.exclude) + self._in_context(committed, suffix)
            if found:
                lengths = [_match_len(sequence, at, committed) for sequence, at in found]
                best = max(lengths)
                found = [f for f, length in zip(found, lengths, strict=True) if length == best]
                return self._follow(found, min(k, max(1, int(self.max_spec_factor * best))))
        return []

    @staticmethod
    def _in_context(committed: list[int], suffix: tuple[int, ...]) -> list[tuple[tuple[int, ...], int]]:
        """Earlier occurrences of suffix in the request's own context (the prompt tree), latest last."""
        n, n_tokens = len(suffix), len(committed)
        if n_tokens <= n:
            return []
        context = tuple(committed)
        first, found = suffix[0], []
        for start in range(n_tokens - n):
            if context[start] == first and context[start : start + n] == suffix:
                found.append((context, start + n))
        return found[-MAX_OCCURRENCES:]

    def _follow(self, found: list[tuple[tuple[int, ...], int]], limit: int) -> list[int]:
        draft: list[int] = []
        live = found
        while len(draft) < limit:
            votes: Counter[int] = Counter()
            latest: dict[int, int] = {}
            for i, (sequence, at) in enumerate(live):
                if at < len(sequence):
                    votes[sequence[at]] += 1
                    latest[sequence[at]] = i
            if not votes:
                break
            token, count = max(votes.items(), key=lambda t: (t[1], latest[t[0]]))
            if count / len(live) < self.min_token_prob:
                break
            draft.append(token)
            live = [(sequence, at + 1) for sequence, at in live if at < len(sequence) and sequence[at] == token]
        return draft

    def on_verified(self, num_accepted: int, num_drafted: int) -> None:
        pass

    def observe_target(self, hidden: Tensor, num_accepted: int) -> None:
        pass
