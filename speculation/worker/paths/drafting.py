"""Teacher-forced passes for the shadow measurement of sampled traffic (on the engine's models).

``teacher_forced_logits`` / ``teacher_forced_probs``: a model's prediction at every output position of a
finished request (one teacher-forced pass), draft or target.
"""

from __future__ import annotations

import torch

from speculation.engine import Transformer


@torch.inference_mode()
def teacher_forced_logits(
    model: Transformer, prompt_ids: list[int], output_ids: list[int], *, chunk: int = 256
) -> torch.Tensor:
    """[len(output), V]: a model's logits at every output position, teacher forced (draft or target)."""
    tokens = prompt_ids + output_ids[:-1]
    if len(tokens) > model.max_len:
        raise ValueError(f"sequence of {len(tokens)} tokens exceeds the model's cache of {model.max_len}")
    ids = torch.tensor(tokens, device=model.output.weight.device)
    logits = torch.cat([model(ids[s : s + chunk], s).logits for s in range(0, len(tokens), chunk)])  # [P + n - 1, V]
    return logits[len(prompt_ids) - 1 :].float().cpu()


def teacher_forced_probs(model: Transformer, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output), V]: the draft's distribution (temperature 1) at every output position, teacher forced."""
    return torch.softmax(teacher_forced_logits(model, prompt_ids, output_ids), dim=-1)
