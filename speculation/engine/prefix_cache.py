"""Prefix caching for the batch decoder: the KV rows of requests that left, kept so that a request starting with the
same tokens (a shared system prompt, an earlier turn of the conversation, the same prompt again) prefills only what
is new. vLLM and SGLang do the same (automatic prefix caching, RadixAttention); without it a model server that
caches prefixes answers a repeated prompt sooner than ACE's prod path does.

The cached keys and values of positions 0..m-1 depend only on tokens 0..m-1 (causal attention), so a request that
reuses them decodes what it would have decoded with its own prefill. The numbers are those of another prefill's
split (float32 sums in another order: about 1e-6 relative), as with vLLM's prefix cache.

Entries are whole rows (prompt and output) of the target and of the draft model, evicted least recently used
under a byte budget. A match needs ``MIN_MATCH`` tokens in common: below that, copying is not worth the lookup.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor

MIN_MATCH = 16

Rows = list[tuple[Tensor, Tensor]]  # per layer: keys [Hkv, L, D], values


@dataclass
class Entry:
    tokens: tuple[int, ...]  # the target row's tokens: positions 0..len - 1
    target: Rows
    draft: Rows | None  # the draft row's first draft_len positions (it can lag the target's)
    draft_len: int
    nbytes: int


@dataclass(frozen=True)
class Hit:
    entry: Entry
    common: int  # tokens shared with the prompt (at most the entry's length)

    def reusable(self, prompt_len: int, *, draft: bool = False) -> int:
        """Positions a row may take from the entry: shared, cached on that side, and short of the prompt's last token
        (which the first step feeds)."""
        cached = self.entry.draft_len if draft else len(self.entry.tokens)
        return min(self.common, cached, prompt_len - 1)


class PrefixCache:
    """LRU of finished rows under ``max_bytes``; ``put`` when a row leaves, ``match`` when a request joins."""

    def __init__(self, max_bytes: int, *, min_match: int = MIN_MATCH) -> None:
        self.max_bytes = max_bytes
        self.min_match = min_match
        self._entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.bytes = 0
        self.hits = self.lookups = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: list[int]) -> Hit | None:
        """The entry sharing the longest prefix with the prompt (at least min_match tokens), made most recent."""
        self.lookups += 1
        best: Hit | None = None
        wanted = tuple(prompt)
        for entry in self._entries.values():
            common = _common_prefix(entry.tokens, wanted)
            if common >= self.min_match and (best is None or common > best.common):
                best = Hit(entry, common)
        if best is not None:
            self.hits += 1
            self._entries.move_to_end(best.entry.tokens)
        return best

    def put(self, tokens: list[int], target: Rows, draft: Rows | None, draft_len: int) -> bool:
        """Keep a leaving row; an entry whose tokens this one extends goes. False when it is too short or too big."""
        key = tuple(tokens)
        if len(key) < self.min_match:
            return False
        nbytes = sum(k.nbytes + v.nbytes for k, v in target) + sum(k.nbytes + v.nbytes for k, v in draft or [])
        if nbytes > self.max_bytes:
            return False
        for old in list(self._entries):
            if len(old) <= len(key) and key[: len(old)] == old:  # this one holds everything the old one did
                self._drop(old)
            elif len(old) > len(key) and old[: len(key)] == key:  # an older one already holds it all
                self._entries.move_to_end(old)
                return False
        self._entries[key] = Entry(tokens=key, target=target, draft=draft, draft_len=draft_len, nbytes=nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def _drop(self, key: tuple[int, ...]) -> None:
        self.bytes -= self._entries.pop(key).nbytes


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return len(os.path.commonprefix([a[:n], b[:n]]))
