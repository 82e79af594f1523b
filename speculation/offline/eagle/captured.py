"""An endpoint's captured traffic as EAGLE training data (free of Django: the service hands the sequences in).

The captured outputs are the target's own answers to the endpoint's real prompts, the data EAGLE, EAGLE-3 and HASS
train on, so they are used as they are: one teacher-forced target pass per sequence gives its features, with no
generation (collect.collect generates a continuation for a text prompt). A prompt keeps its last max_prompt_tokens
tokens and an output its first new_tokens. The oldest captures of each workload are held out for evaluation.
Nothing of them is written to the run's work directory (features of text prompts are, for a resumed run to reuse):
the features would hold the captured token ids in the clear; a resumed run computes them again.
"""

from __future__ import annotations

import logging

import torch

from speculation.offline.eagle.collect import Sequences, features_of
from speculation.offline.eagle.prompts import CapturedSequence, split_prompts

logger = logging.getLogger(__name__)

UNLABELLED = "captured"  # the category of a capture without a workload key


@torch.no_grad()
def collect_captured(
    model,
    sequences: list[CapturedSequence],
    *,
    max_prompt_tokens: int,
    new_tokens: int,
    feature_layers: tuple[int, ...] = (),
) -> Sequences:
    """Teacher-forced features [T, (n + 1) * H] of each prompt + served output (ids outside the target's vocabulary:
    skipped, logged)."""
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    out = Sequences()
    skipped = 0
    for sequence in sequences:
        prompt, output = sequence.prompt_ids[-max_prompt_tokens:], sequence.output_ids[:new_tokens]
        ids = torch.tensor(prompt + output, dtype=torch.long)
        if not prompt or not output or int(ids.max()) >= vocab or int(ids.min()) < 0:
            skipped += 1
            continue
        out.tokens.append(ids)
        out.features.append(features_of(model, ids[None].to(device), feature_layers)[0].cpu())
        out.prompt_lens.append(len(prompt))
        out.categories.append(sequence.category or UNLABELLED)
    if skipped:
        logger.warning("%d captured sequences skipped: empty, or ids outside the target's vocabulary", skipped)
    return out


def captured_sets(
    model, sequences: list[CapturedSequence], *, settings, feature_layers: tuple[int, ...], progress
) -> tuple[Sequences, Sequences]:
    """(training, held-out) features of captured sequences; ValueError when too few to hold any out."""
    train_part, test_part = split_prompts(sequences, held_out=settings.held_out)
    if not train_part or not test_part:
        raise ValueError(f"{len(sequences)} captured requests are too few to train on and hold some out")
    progress.stage("collect", f"{len(train_part)} training and {len(test_part)} held-out captured requests")
    options = {"max_prompt_tokens": settings.max_prompt_tokens, "new_tokens": settings.new_tokens,
               "feature_layers": feature_layers}  # fmt: skip
    train, held_out = collect_captured(model, train_part, **options), collect_captured(model, test_part, **options)
    if not len(train) or not len(held_out):
        raise ValueError("no captured request fits the target's vocabulary: was it captured from another model?")
    return train, held_out
