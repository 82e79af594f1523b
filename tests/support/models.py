"""Tiny seeded engine models built in the test (no checkpoint needed)."""

from __future__ import annotations

from pathlib import Path

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


@torch.inference_mode()
def served_reference(model: Transformer, prompt_ids: list[int], *, tokens: int = 8, top_n: int | None = 5) -> dict:
    """The probe's `canary_reference` as a server running `model` would record it: its greedy continuation of
    prompt_ids and its top_n log-probabilities at every position (top_n None: a server that returns none)."""
    sequence = list(prompt_ids)
    for _ in range(tokens):
        model.setup_cache(len(sequence) + 1)
        logits = model(torch.tensor(sequence), 0).logits
        sequence.append(int(logits[-1].argmax()))
    model.setup_cache(len(sequence))
    logprobs = torch.log_softmax(model(torch.tensor(sequence), 0).logits, dim=-1)
    top = None
    if top_n:
        top = [None] + [[[int(t), float(lp)] for lp, t in zip(*row.topk(top_n), strict=True)] for row in logprobs[:-1]]
    return {"token_ids": sequence, "prompt_len": len(prompt_ids), "top_logprobs": top, "greedy_only": ""}


def served_reference_of(model_dir, prompt_text: str | None = None, **kwargs) -> dict:
    """served_reference for the checkpoint in model_dir on the probe's canary (as its tokenizer encodes it)."""
    from tokenizers import Tokenizer

    from fleet.adapters import CANARY_TEXT
    from speculation.engine import load_causal_lm

    model_dir = Path(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tokenizer.encode(prompt_text or CANARY_TEXT, add_special_tokens=True).ids
    return served_reference(load_causal_lm(model_dir), ids, **kwargs)


_references: dict[str, dict] = {}


def serves(endpoint, model_dir) -> None:
    """Record on the endpoint what its probe would if its server ran the checkpoint in model_dir: the canary
    reference a local target must reproduce (speculation.services.target_identity)."""
    from fleet.models import Endpoint

    key = str(model_dir)
    if key not in _references:
        _references[key] = served_reference_of(model_dir)
    endpoint.capabilities = {**(endpoint.capabilities or {}), "canary_reference": _references[key]}
    Endpoint.objects.filter(pk=endpoint.pk).update(capabilities=endpoint.capabilities)
