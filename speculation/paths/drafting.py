"""Draft-side pieces the worker paths need: greedy proposals with a reusable KV cache, teacher-forced
predictions for the shadow replay, and the n-gram proposer.

Built on the engine's public pieces when they are there (speculation.engine), else on transformers directly.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def load_model(directory: str | Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.eval()
    return model


class GreedyDraft:
    """Greedy proposals from a causal LM; the KV cache is kept across steps and cropped to the common prefix."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache = None
        self.cached: list[int] = []  # the tokens whose keys/values are in the cache

    def _common_prefix(self, context: list[int]) -> int:
        n = min(len(self.cached), len(context))
        i = 0
        while i < n and self.cached[i] == context[i]:
            i += 1
        return i

    @torch.inference_mode()
    def _feed(self, tokens: list[int]) -> torch.Tensor:
        from transformers import DynamicCache

        if self.cache is None:
            self.cache = DynamicCache()
        ids = torch.tensor([tokens], dtype=torch.long)  # [1, T]
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True)
        self.cache = getattr(out, "cache", None) or out.past_key_values
        self.cached.extend(tokens)
        return out.logits[0, -1]  # [V]

    def propose(self, context: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        keep = self._common_prefix(context)
        if keep == len(context):
            keep -= 1  # the last context token must be fed again to get its logits
        if self.cache is not None and keep < len(self.cached):
            self.cache.crop(keep - len(self.cached))  # a negative count: tokens removed from the end
            self.cached = self.cached[:keep]
        logits = self._feed(context[keep:])
        drafts: list[int] = []
        for _ in range(k):
            token = int(torch.argmax(logits))
            drafts.append(token)
            if len(drafts) == k:
                break
            logits = self._feed([token])
        return drafts

    def reset(self) -> None:
        self.cache = None
        self.cached = []


@torch.inference_mode()
def teacher_forced_next(model: torch.nn.Module, prompt_ids: list[int], output_ids: list[int]) -> list[int]:
    """draft_next[i] = the draft's argmax after prompt + output[:i], for i in 0..len(output)-1 (one pass)."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]], dtype=torch.long)  # [1, P + n - 1]
    logits = model(input_ids=ids).logits[0]  # [P + n - 1, V]
    return torch.argmax(logits[len(prompt_ids) - 1 :], dim=-1).tolist()


@torch.inference_mode()
def teacher_forced_probs(model: torch.nn.Module, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output), V]: the draft's distribution (temperature 1) at every output position, teacher forced."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]], dtype=torch.long)  # [1, P + n - 1]
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 :]  # [n, V]
    return torch.softmax(logits.float(), dim=-1)


class NgramDraft:
    """Prompt lookup: continue the longest recent n-gram match in the context (zero VRAM)."""

    def __init__(self, *, max_n: int = 3, min_n: int = 1) -> None:
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, context: list[int], k: int) -> list[int]:
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(context) <= n:
                continue
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start : start + n] == tail:
                    follow = context[start + n : start + n + k]
                    if follow:
                        return follow
        return []
