"""Rotary position embeddings as transformers computes them (rope types default, linear, dynamic, llama3, yarn;
partial rotary; Gemma 3's second table for its sliding layers), in tables the model and its cache rows read."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from speculation.engine.families import ModelArgs, Rope


def inverse_frequencies(rope: Rope, theta: float, dim: int) -> tuple[Tensor, float]:
    """Per rotated pair, the angle per position [dim / 2], and the factor cos and sin are scaled by (yarn), as
    transformers' modeling_rope_utils computes them for rope types default, linear, dynamic, llama3 and yarn."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta**exponents)
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        low_wavelen = rope.original_max_positions / rope.low_freq_factor
        high_wavelen = rope.original_max_positions / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.type == "yarn":
        return _yarn(rope, theta, dim)
    return inv_freq, 1.0  # default; dynamic within max_position_embeddings


def _yarn(rope: Rope, theta: float, dim: int) -> tuple[Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = rope.factor
    attention = rope.attention_factor
    if attention is None:
        both = rope.mscale and rope.mscale_all_dim
        attention = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim) if both else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def rope_tables(args: ModelArgs, device: torch.device, theta: float | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin per position [max_positions, R] (R the rotated width) in Hugging Face's rotate-half layout, the
    sine's first half negated (the sign of rotate-half moved into the table, so that apply_rope needs no negation).
    theta: another base (Gemma 3's sliding layers), with the default rotation."""
    dim = args.rotary_dim
    rope = args.rope if theta is None else Rope()
    inv_freq, scale = inverse_frequencies(rope, args.rope_theta if theta is None else theta, dim)
    freqs = torch.outer(torch.arange(args.max_positions, dtype=torch.float32), inv_freq)  # [S, R/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, R]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    sin[:, : dim // 2].neg_()
    return cos.to(device), sin.to(device)


def rope_tables_of(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
    """The model's rope tables in ``dtype``: the global one, and Gemma 3's sliding layers' own when it has one."""
    thetas = [None] if args.local_rope_theta is None else [None, args.local_rope_theta]
    return [(cos.to(dtype), sin.to(dtype)) for cos, sin in (rope_tables(args, device, theta) for theta in thetas)]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin with rope_tables' signed sine: rotate-half is a roll by half the head width
    (four operations; bitwise the cat-and-negate form). x [..., D], the tables broadcast to it."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """apply_rope over the first cos.shape[-1] of each head (all of it but for a partial rotary)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
