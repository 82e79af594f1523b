"""Suffix decoding: draft from what the target answered before (SuffixDecoding, Oliaro et al. 2024; vLLM's
``method: "suffix"`` through Arctic Inference).

Prompt lookup (``NgramProposer``) copies from the request's own context. Suffix decoding also looks in a store of
earlier responses: where the last tokens of the context occurred before, in this request or in a cached answer,
the continuation the target wrote most often after them is the draft. Workloads whose answers repeat (agents,
templated extraction, a model that quotes the same passages) accept long drafts; elsewhere it finds nothing and
costs nearly nothing (a dictionary lookup per step, no model).

``SuffixIndex`` is the store: sequences of token ids (the earlier responses) under a key each, the oldest dropped
past ``max_sequences``, indexed by their n-grams of lengths 1, 2 and 4 (a bounded number of latest positions per
n-gram). ``SuffixProposer`` drafts from an index and the request's own context:

1. the longest suffix of the context (of 4, 2 or 1 tokens) that occurs in the index or earlier in the context; no
   match, no draft. Its occurrences are then compared further back (up to ``MAX_DEPTH`` tokens, as
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

from speculation.engine.proposers import LookupProposer

KEY_LENGTHS = (1, 2, 4)  # the n-gram lengths the index keys (a match of 3 is looked up as 2 and compared back)
STRIDE = 1 << 20  # a stored position is serial * STRIDE + offset (responses are cut at STRIDE - 1 tokens)
MAX_DEPTH = 32  # how far back the occurrences found are compared with the context
MAX_OCCURRENCES = 32  # latest positions kept per n-gram (and voted over)
MIN_TOKEN_PROB = 0.1  # SuffixDecoding's default: stop where the best continuation has less support
MAX_SPEC_FACTOR = 2.0  # at most this x the match length drafted (SuffixDecoding's spec factor; vLLM's default 1.0)


class SuffixIndex:
    """Earlier responses, looked up by their n-grams (lengths KEY_LENGTHS). Thread-safe: the worker's batch loop
    reads it while a request's completion adds to it. Compact: an n-gram is keyed by its hash (an occurrence is
    checked token by token when looked up), a position is one integer, and evicted responses' positions are swept
    out by a rebuild once as many have gone as the index holds."""

    def __init__(self, *, max_sequences: int = 2000):
        if max_sequences < 1:
            raise ValueError("max_sequences must be >= 1")
        self.max_sequences = max_sequences
        self._sequences: OrderedDict[str, tuple[tuple[int, ...], int]] = OrderedDict()  # key -> (tokens, serial)
        self._serial = 0
        self._stale = 0  # responses evicted since the last rebuild (their positions are skipped until then)
        # hash(n-gram) -> a position serial * STRIDE + end (the n-gram ends at end - 1, sequence[end] follows) or a
        # list of them, latest last
        self._positions: dict[int, int | list[int]] = {}
        self._by_serial: dict[int, tuple[tuple[int, ...], str]] = {}
        self._rebuilding = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sequences)

    def __contains__(self, key: str) -> bool:
        return key in self._sequences

    @property
    def tokens(self) -> int:
        return sum(len(s) for s, _ in self._sequences.values())

    def add(self, key: str, tokens: Iterable[int]) -> None:
        """Store a response under key (a key already stored is left as it is)."""
        sequence = tuple(int(t) for t in tokens)[: STRIDE - 1]
        with self._lock:
            if key in self._sequences or len(sequence) < 2:
                return
            self._serial += 1
            self._sequences[key] = (sequence, self._serial)
            self._by_serial[self._serial] = (sequence, key)
            self._index(sequence, self._serial)
            while len(self._sequences) > self.max_sequences:
                _, (_, gone) = self._sequences.popitem(last=False)
                del self._by_serial[gone]
                self._stale += 1
            if self._stale < self.max_sequences or self._rebuilding:
                return
            self._rebuilding, live = True, list(self._sequences.values())
        self._rebuild(live)

    def _index(self, sequence: tuple[int, ...], serial: int) -> None:
        positions = self._positions
        for end in range(1, len(sequence)):
            position = serial * STRIDE + end
            for n in KEY_LENGTHS:
                if n > end:
                    break
                gram = hash(sequence[end - n : end])
                found = positions.get(gram)
                if found is None:
                    positions[gram] = position
                elif type(found) is int:
                    positions[gram] = [found, position]
                else:
                    found.append(position)
                    if len(found) > MAX_OCCURRENCES:
                        del found[0]

    def _rebuild(self, live: list[tuple[tuple[int, ...], int]]) -> None:
        """A fresh index of the live answers, built outside the lock (lookups go on meanwhile), then swapped in
        with the answers added during the build indexed into it too."""
        fresh = SuffixIndex(max_sequences=self.max_sequences)
        for sequence, serial in live:
            fresh._index(sequence, serial)
        built_upto = max((serial for _, serial in live), default=0)
        with self._lock:
            for sequence, serial in self._sequences.values():
                if serial > built_upto:
                    fresh._index(sequence, serial)
            self._positions, self._stale, self._rebuilding = fresh._positions, 0, False

    def occurrences(self, suffix: tuple[int, ...], exclude: str = "") -> list[tuple[tuple[int, ...], int]]:
        """(sequence, position after the suffix) for the stored occurrences of suffix (one of the key lengths),
        latest last."""
        n = len(suffix)
        with self._lock:
            found = self._positions.get(hash(suffix))
            if found is None:
                return []
            out = []
            for position in (found,) if type(found) is int else found:
                stored = self._by_serial.get(position // STRIDE)
                end = position % STRIDE
                if stored is not None and stored[1] != exclude and stored[0][end - n : end] == suffix:
                    out.append((stored[0], end))
            return out


def _match_len(sequence: tuple[int, ...], at: int, committed: list[int]) -> int:
    """How many tokens before sequence[at] equal the context's last ones (up to MAX_DEPTH)."""
    n_tokens, length = len(committed), 0
    while length < MAX_DEPTH and length < at and length < n_tokens:
        if sequence[at - length - 1] != committed[n_tokens - length - 1]:
            break
        length += 1
    return length


class SuffixProposer(LookupProposer):
    """Drafts the most frequent earlier continuation of the context's longest matching suffix (see the module)."""

    def __init__(
        self,
        index: SuffixIndex | None = None,
        *,
        exclude: str = "",
        min_token_prob: float = MIN_TOKEN_PROB,
        max_spec_factor: float = MAX_SPEC_FACTOR,
    ):
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError("min_token_prob must be in [0, 1]")
        if max_spec_factor <= 0:
            raise ValueError("max_spec_factor must be > 0")
        self.index = index if index is not None else SuffixIndex()
        self.exclude = exclude
        self.min_token_prob, self.max_spec_factor = min_token_prob, max_spec_factor

    @property
    def batch_key(self) -> tuple:
        """One batch per store (the endpoint's index grows in place while the batch drafts from it)."""
        return ("suffix", id(self.index), self.exclude, self.min_token_prob, self.max_spec_factor)

    def lookup(self, committed: list[int], k: int) -> list[int]:
        """Up to k draft tokens to follow committed (the batch loop calls this directly, as NgramProposer's)."""
        n_tokens = len(committed)
        if k <= 0 or n_tokens == 0:
            return []
        for n in reversed(KEY_LENGTHS):
            if n > n_tokens:
                continue
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
