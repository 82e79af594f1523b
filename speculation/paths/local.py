"""Local path: the target's weights are loaded in the GPU worker; one forward pass verifies K drafts.

The target keeps its KV cache across steps; after a rejection it is cropped back to the committed prefix
(rolling back is moving the end of the cache).
"""

from __future__ import annotations

import torch

from speculation.paths.drafting import GreedyDraft


class LocalGreedyVerifier:
    def __init__(self, model: torch.nn.Module) -> None:
        self._runner = GreedyDraft(model)  # same cache discipline: crop to the common prefix, feed the rest

    @torch.inference_mode()
    def verify(self, context: list[int], drafts: list[int]) -> tuple[int, int]:
        runner = self._runner
        keep = runner._common_prefix(context)
        if keep == len(context):
            keep -= 1
        if runner.cache is not None and keep < len(runner.cached):
            runner.cache.crop(keep - len(runner.cached))
            runner.cached = runner.cached[:keep]
        fed = context[keep:] + drafts
        ids = torch.tensor([fed], dtype=torch.long)  # [1, T]
        from transformers import DynamicCache

        if runner.cache is None:
            runner.cache = DynamicCache()
        out = runner.model(input_ids=ids, cache=runner.cache, use_cache=True)
        runner.cache = getattr(out, "cache", None) or out.past_key_values
        runner.cached.extend(fed)
        # preds[j]: the target's argmax after context + drafts[:j]
        preds = torch.argmax(out.logits[0, -(len(drafts) + 1) :], dim=-1).tolist()  # [K + 1]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == preds[accepted]:
            accepted += 1
        return accepted, int(preds[accepted])
