"""Tiny seeded engine models built in the test (no checkpoint needed)."""

from __future__ import annotations

import torch

from speculation.engine import ModelArgs, Transformer, init_weights


def tiny_model(
    *, vocab: int = 48, dim: int = 32, layers: int = 2, seed: int = 0, std: float = 0.5, max_positions: int = 256
) -> Transformer:
    """A random Llama whose logits are decisive (large init), so greedy argmaxes are rarely near-ties."""
    args = ModelArgs(
        vocab_size=vocab,
        dim=dim,
        n_layers=layers,
        n_heads=4,
        n_kv_heads=2,
        intermediate_size=2 * dim,
        max_positions=max_positions,
    )
    model = Transformer(args)
    init_weights(model, torch.Generator().manual_seed(seed), std=std)
    model.eval().requires_grad_(False)
    model.setup_cache()
    return model


def draft_of(target: Transformer, *, seed: int = 1, noise: float = 0.03) -> Transformer:
    """A one-layer draft sharing the target's embeddings, first block and head, with noise: it often agrees."""
    args = ModelArgs(**{**target.args.__dict__, "n_layers": 1})
    draft = Transformer(args)
    state = {k: v for k, v in target.state_dict().items() if not k.startswith("layers.") or k.startswith("layers.0.")}
    draft.load_state_dict(state)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * noise * p.std())
    draft.eval().requires_grad_(False)
    draft.setup_cache()
    return draft
