"""A draft's logits read against its target's vocabulary when the two checkpoints pad it to different sizes.

Checkpoints pad ``vocab_size`` past their tokenizer's (Qwen's 151,936 and 152,064 rows for one 151,665-token
tokenizer), so a draft and a target of one tokenizer can have logits of different widths. Ids below the tokenizer's
size (``shared_vocab``) mean the same token to both; the draft drafts among those only, and its distribution is
widened to the target's with zeros (logits of -inf) for the rest. Verification stays exact: it only needs q to be
the distribution the draft sampled from, over the target's ids. That the two share a tokenizer is the caller's to
check (speculation.services.policies compares tokenizer fingerprints); different tokenizers are refused there.
"""

from __future__ import annotations

from torch import Tensor

from speculation.engine.errors import VocabMismatchError


def draft_width(draft_vocab: int, target_vocab: int, shared_vocab: int | None = None) -> int:
    """How many of the draft's logits are read: all when both have one size; else the shared tokenizer's ids."""
    if draft_vocab == target_vocab:
        return draft_vocab
    if shared_vocab is None:
        raise VocabMismatchError(
            f"draft vocabulary ({draft_vocab}) differs from the target's ({target_vocab}) and no shared tokenizer "
            "vocabulary is given"
        )
    if not 0 < shared_vocab <= min(draft_vocab, target_vocab):
        raise VocabMismatchError(
            f"the tokenizer's {shared_vocab} tokens do not fit both the draft's vocabulary ({draft_vocab}) and the "
            f"target's ({target_vocab})"
        )
    return shared_vocab


def widen(logits: Tensor, width: int, target_vocab: int) -> Tensor:
    """[..., V_draft] -> [..., V_target]: the first ``width`` logits, -inf past them (ids the draft never drafts)."""
    if width == logits.shape[-1] == target_vocab:
        return logits
    out = logits.new_full((*logits.shape[:-1], target_vocab), float("-inf"))
    out[..., :width] = logits[..., :width]
    return out
