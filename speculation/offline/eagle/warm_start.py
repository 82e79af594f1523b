"""Warm start: a training run that continues from a saved EAGLE head instead of the seeded initialisation.

EAGLE-3's recipes, SpecForge and speculators fine-tune an existing head on new data rather than train one from
scratch: a head trained for hours on a broad corpus keeps what it learnt and adapts to an endpoint's own traffic in
a few epochs of a few dozen requests. The run trains the head in its own layout (format, feature layers, MLP width),
so the head it starts from must fit the run: the same target, the same kind of head (single- or multi-layer) and a
vocabulary the training loss covers. Torch-free: the web process refuses a mismatch before a run is queued.
"""

from __future__ import annotations

from typing import Any

from speculation.engine.eagle_format import (
    ACE_SECTION,
    FORMAT_EAGLE1,
    FORMAT_EAGLE3,
    aux_layer_ids,
    eagle3_problems,
    head_format,
    is_head_config,
    layer_config,
)
from speculation.offline.eagle.settings import TrainSettings

# A quarter of the from-scratch learning rate: the head starts near a good optimum, and a run on a few dozen
# captured requests at the full rate would overwrite what the head learnt on its large corpus before the held-out
# epochs could tell (demo_head.FINE_TUNE halves it for more epochs on the head's own corpus).
WARM_START_LR = TrainSettings.lr / 4


def warm_start_problems(
    head: dict[str, Any],
    *,
    target: dict[str, Any],
    target_fingerprint: str,
    multi_layer: bool,
    intermediate_size: int = 0,
) -> list[str]:
    """Why the head whose config.json is `head` cannot start a run for the target whose config.json is `target`
    (fingerprint `target_fingerprint`) on a recipe with `multi_layer` and `intermediate_size` (0: any); [] when
    it can."""
    if not is_head_config(head):
        return ["not an EAGLE head (its config.json has neither ACE's ace_eagle section nor an EAGLE-3 architecture)"]
    fmt = head_format(head)
    meta = head.get(ACE_SECTION) if isinstance(head.get(ACE_SECTION), dict) else {}
    layer = {**layer_config(head), **meta}
    problems = []
    if multi_layer and fmt == FORMAT_EAGLE1:
        problems.append("a single-layer head (format 1) for a multi-layer recipe (multi_layer set)")
    if not multi_layer and fmt != FORMAT_EAGLE1:
        problems.append(f"a multi-layer head (format {fmt}) for a single-layer recipe (multi_layer not set)")
    fingerprint = meta.get("target_fingerprint")
    if fingerprint and target_fingerprint and fingerprint != target_fingerprint:
        problems.append(f"trained for target {meta.get('target_name')!r} (fingerprint {fingerprint}), not this one "
                        f"({target_fingerprint})")  # fmt: skip
    for key, name in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary")):
        if layer.get(key) != target.get(key):
            problems.append(f"{name} {layer.get(key)} (the target's: {target.get(key)})")
    if intermediate_size and layer.get("intermediate_size") != intermediate_size:
        problems.append(f"MLP width {layer.get('intermediate_size')} (the recipe's: {intermediate_size})")
    if fmt == FORMAT_EAGLE3:
        problems += eagle3_problems(head)
        draft_vocab = layer.get("draft_vocab_size") or 0
        if draft_vocab and draft_vocab != layer.get("vocab_size"):
            problems.append(f"a reduced draft vocabulary ({draft_vocab} tokens): runs train on the target's full one")
        layers = target.get("num_hidden_layers") or 0
        ids = aux_layer_ids(head) or []
        if any(i > layers for i in ids):
            problems.append(f"aux layers {ids} (the target has {layers} layers)")
    return problems
