"""A small Llama of our own (gpt-fast style) with a preallocated KV cache indexed by position.

Rolling back after a rejection is moving the position: entries past it are simply overwritten later.
One forward call takes any number of new tokens at consecutive positions, so a single target pass
verifies K draft tokens plus the bonus position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    max_positions: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class KVCache(nn.Module):
    def __init__(self, n_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        shape = (1, n_kv_heads, max_len, head_dim)  # [B, H, S, D]
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]  # [B, H, end, D]

    def move(self, src: Tensor, dst: int) -> None:
        """Copy slots src [n] to dst..dst+n-1 (a draft tree's accepted path; the source is read first)."""
        n = src.shape[0]
        self.k[:, :, dst : dst + n] = self.k[:, :, src]
        self.v[:, :, dst : dst + n] = self.v[:, :, src]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # x * rsqrt(mean(x^2) + eps) * weight, as Hugging Face's LlamaRMSNorm, in one call (bitwise the same here)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(args: ModelArgs, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin per position [max_positions, D] in Hugging Face's rotate-half layout, the sine's first half negated
    (the sign of rotate-half moved into the table, so that apply_rope needs no negation)."""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim))
    freqs = torch.outer(torch.arange(args.max_positions, dtype=torch.float32), inv_freq)  # [S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
    sin = emb.sin()
    sin[:, : args.head_dim // 2].neg_()
    return emb.cos().to(device), sin.to(device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin with rope_tables' signed sine: rotate-half is a roll by half the head width
    (four operations; bitwise the cat-and-negate form). x [..., D], the tables broadcast to it."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        kv_dim = args.n_kv_heads * args.head_dim
        self.wqkv = nn.Linear(args.dim, args.dim + 2 * kv_dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x: Tensor, start: int, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        a = self.args
        bsz, t, _ = x.shape
        qkv = self.wqkv(x).view(bsz, t, a.n_heads + 2 * a.n_kv_heads, a.head_dim)
        qk = apply_rope(qkv[:, :, : a.n_heads + a.n_kv_heads].transpose(1, 2), cos, sin)  # q and k at once
        q, k = qk[:, : a.n_heads], qk[:, a.n_heads :]  # [B, H, T, D], [B, Hkv, T, D]
        v = qkv[:, :, a.n_heads + a.n_kv_heads :].transpose(1, 2)
        if self.cache is None:
            raise RuntimeError("call setup_cache() before forward()")
        k, v = self.cache.update(start, k, v)  # [B, Hkv, start + T, D]
        if a.n_kv_heads != a.n_heads:
            k = k.repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
            v = v.repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, D]
        return self.wo(y.transpose(1, 2).reshape(bsz, t, a.dim))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hidden = args.intermediate_size
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.hidden, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, start: int, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), start, cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


# What a forward returns as features: False none, True the final-norm output [T, D] (EAGLE-1's feature), or a
# tuple of layer indices: those layers' outputs and the final-norm output concatenated, [T, (n + 1) * D] (EAGLE-3's
# low / mid / high features).
HiddenRequest = bool | tuple[int, ...]


@dataclass
class ForwardOutput:
    logits: Tensor  # [T, V] float32
    hidden: Tensor | None  # [T, D] or [T, (n + 1) * D]: the features asked for (HiddenRequest)


class Transformer(nn.Module):
    """Batch-1 causal LM. ``forward(tokens, start)`` writes positions start..start+T-1 into the cache."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.max_len = 0
        self._cos: Tensor | None = None
        self._sin: Tensor | None = None

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def setup_cache(self, max_len: int | None = None) -> None:
        max_len = min(max_len or self.args.max_positions, self.args.max_positions)
        param = self.output.weight
        for layer in self.layers:
            layer.attention.cache = KVCache(
                self.args.n_kv_heads, max_len, self.args.head_dim, param.dtype, param.device
            )
        self._cos, self._sin = (t.to(param.dtype) for t in rope_tables(self.args, param.device))
        self.max_len = max_len

    def forward(
        self,
        tokens: Tensor,
        start: int,
        return_hidden: HiddenRequest = False,
        *,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> ForwardOutput:
        """tokens: [T] ids at positions start..start+T-1 -> logits [T, V] (and the features return_hidden asks for).

        A draft tree (engine/tree.py) passes its nodes' RoPE ``positions`` [T] and the ``mask`` [T, start + T]
        (bool: the cached and new slots each new token sees); the cache slots stay start..start+T-1.
        """
        t = tokens.shape[-1]
        if self._cos is None or self._sin is None:
            raise RuntimeError("call setup_cache() before forward()")
        if start + t > self.max_len:
            raise ValueError(f"positions {start}..{start + t - 1} exceed the KV cache of {self.max_len}")
        if positions is None:
            cos, sin = self._cos[start : start + t], self._sin[start : start + t]  # [T, D]
        else:
            cos, sin = self._cos[positions], self._sin[positions]
        if mask is None and t > 1:  # new token i sees every cached position and the new ones up to itself
            mask = torch.ones(t, start + t, dtype=torch.bool, device=tokens.device).tril(diagonal=start)
        taps = () if isinstance(return_hidden, bool) else return_hidden
        tapped = []
        x = self.tok_embeddings(tokens.view(1, t))  # [1, T, D]
        for i, layer in enumerate(self.layers):
            x = layer(x, start, cos, sin, mask)
            if i in taps:
                tapped.append(x[0])
        hidden = self.norm(x)[0]  # [T, D]
        logits = self.output(hidden).float()  # [T, V]
        if not return_hidden:
            return ForwardOutput(logits=logits, hidden=None)
        return ForwardOutput(logits=logits, hidden=torch.cat([*tapped, hidden], dim=-1) if tapped else hidden)

    def keep_cache_slots(self, slots: Tensor, start: int) -> None:
        """Move the cache slots [n] to start..start+n-1 in every layer (what a draft tree's accepted path keeps)."""
        for layer in self.layers:
            layer.attention.cache.move(slots, start)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def init_weights(model: Transformer, generator: torch.Generator, std: float = 0.02) -> None:
    """Random init for tests and timing runs (no checkpoint needed)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
            if "wo" in name or "w2" in name:
                p.mul_(1.0 / math.sqrt(2 * model.args.n_layers))
