"""One decoder-only transformer (gpt-fast style) for every supported family, with a preallocated KV cache indexed
by position.

Rolling back after a rejection is moving the position: entries past it are simply overwritten later.
One forward call takes any number of new tokens at consecutive positions, so a single target pass
verifies K draft tokens plus the bonus position. What differs between Llama, Mistral, Qwen, Gemma and Phi-3
(engine/families.py) is data in ``ModelArgs``: biases, q/k norms, Gemma's norms and soft-capping, sliding windows,
partial rotary and rope scaling. The batch model (batch_model.py) runs these same blocks over its own cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speculation.engine.families import ModelArgs, Rope


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
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset  # Gemma: the weight is stored as w and applied as 1 + w
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if self.offset:  # Gemma: (x * rsqrt(mean(x^2) + eps)) * (1 + w) in float32, then cast, as transformers
            return F.rms_norm(x.float(), (x.shape[-1],), self.offset + self.weight.float(), self.eps).type_as(x)
        # x * rsqrt(mean(x^2) + eps) * weight, as Hugging Face's LlamaRMSNorm, in one call (bitwise the same here)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


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


def sliding(mask: Tensor | None, query_pos: Tensor, key_pos: Tensor, window: int) -> Tensor:
    """mask (None: every key) narrowed to the keys within ``window`` positions of each query (itself included,
    as transformers' sliding_window_overlay). query_pos [..., T], key_pos [L] -> [..., T, L]."""
    near = query_pos.unsqueeze(-1) - key_pos < window
    return near if mask is None else mask & near


class Attention(nn.Module):
    """Grouped-query attention in three steps, so that the single and the batch cache share them: ``project`` (q, k,
    v with their rotation), the cache write (the caller's), ``attend`` (scores, soft-cap, output projection)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wqkv = nn.Linear(args.dim, q_dim + 2 * kv_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(q_dim, args.dim, bias=args.o_bias)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, args.norm_offset) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, args.norm_offset) if args.qk_norm else None
        self.scale = args.attn_scale or None  # None: SDPA's own 1 / sqrt(head_dim)
        self.cache: KVCache | None = None

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, dim], cos / sin [T, R] or [B, T, R] -> q [B, H, T, D], k and v [B, Hkv, T, D]."""
        a = self.args
        bsz, t, _ = x.shape
        heads = a.n_heads + a.n_kv_heads
        qkv = self.wqkv(x).view(bsz, t, heads + a.n_kv_heads, a.head_dim)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
        if self.q_norm is None:
            qk = rotate(qkv[:, :, :heads], cos, sin)  # q and k at once, [B, T, H + Hkv, D]
            q, k = qk[:, :, : a.n_heads], qk[:, :, a.n_heads :]
        else:
            q = rotate(self.q_norm(qkv[:, :, : a.n_heads]), cos, sin)
            k = rotate(self.k_norm(qkv[:, :, a.n_heads : heads]), cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), qkv[:, :, heads:].transpose(1, 2)

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
        """q [B, H, T, D] over keys / values [B, Hkv, L, D] (mask [T, L] or [B, 1, T, L] bool) -> [B, T, dim]."""
        a = self.args
        bsz, _, t, _ = q.shape
        if a.n_kv_heads != a.n_heads:
            keys = keys.repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
            values = values.repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
        if a.attn_softcap is None:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)  # [B, H, T, D]
        else:  # Gemma 2: cap * tanh(scores / cap) before the mask, softmax in float32 (transformers' eager path)
            scores = (q @ keys.transpose(-1, -2)) * (self.scale or a.head_dim**-0.5)  # [B, H, T, L]
            scores = torch.tanh(scores / a.attn_softcap) * a.attn_softcap
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            y = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ values
        return self.wo(y.transpose(1, 2).reshape(bsz, t, a.n_heads * a.head_dim))

    def forward(self, x: Tensor, start: int, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        if self.cache is None:
            raise RuntimeError("call setup_cache() before forward()")
        q, k, v = self.project(x, cos, sin)
        k, v = self.cache.update(start, k, v)  # [B, Hkv, start + T, D]
        return self.attend(q, k, v, mask)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hidden = args.intermediate_size
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)
        self.gelu = args.activation == "gelu_tanh"

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.hidden, dim=-1)
        return self.w2((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm: nn.Module = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        # Gemma 2/3: the attention's and the feed-forward's outputs are normed too before the residual add
        self.attention_out_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset) if args.sandwich_norms else None
        self.ffn_out_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset) if args.sandwich_norms else None

    def forward(self, x: Tensor, start: int, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        return self.run(x, lambda h: self.attention(h, start, cos, sin, mask))

    def run(self, x: Tensor, attention: Callable[[Tensor], Tensor]) -> Tensor:
        """The residual stream around ``attention`` (normed input -> output, over whichever cache) and the MLP."""
        a = attention(self.attention_norm(x))
        h = x + (a if self.attention_out_norm is None else self.attention_out_norm(a))
        f = self.feed_forward(self.ffn_norm(h))
        return h + (f if self.ffn_out_norm is None else self.ffn_out_norm(f))


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

    implementation = "native"  # ACE's own layer (a model transformers runs for it is engine/generic.py's)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.max_len = 0
        # per layer: which rope table (0 global, 1 Gemma 3's sliding layers' own) and its window (None: all keys)
        local = args.local_rope_theta is not None
        self.layer_rope = tuple(int(local and args.window(i) is not None) for i in range(args.n_layers))
        self.tables: list[tuple[Tensor, Tensor]] = []  # cos, sin [max_positions, R] per rope table
        self._embed_scale: Tensor | None = None

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
        self.tables = rope_tables_of(self.args, param.device, param.dtype)
        if self.args.embed_scale != 1.0:  # rounded to the weights' dtype, as transformers' scaled embedding
            self._embed_scale = torch.tensor(self.args.embed_scale, dtype=param.dtype, device=param.device)
        self.max_len = max_len

    def embed(self, tokens: Tensor) -> Tensor:
        x = self.tok_embeddings(tokens)
        return x if self._embed_scale is None else x * self._embed_scale

    def logits(self, hidden: Tensor) -> Tensor:
        """The LM head over final-norm features, in float32 (Gemma 2: soft-capped)."""
        logits = self.output(hidden).float()
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def layer_masks(
        self, mask: Tensor | None, reach: int, positions: Callable[[], tuple[Tensor, Tensor]]
    ) -> dict[int | None, Tensor | None]:
        """The mask of each distinct window: ``mask`` for full attention, narrowed for a window shorter than
        ``reach`` (query to key distance + 1 at most); positions() -> (query positions, key positions)."""
        masks: dict[int | None, Tensor | None] = {None: mask}
        for window in set(self.args.windows) - {None}:
            if window >= reach:
                masks[window] = mask
            else:
                query_pos, key_pos = positions()
                masks[window] = sliding(mask, query_pos, key_pos, window)
        return masks

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
        if not self.tables:
            raise RuntimeError("call setup_cache() before forward()")
        if start + t > self.max_len:
            raise ValueError(f"positions {start}..{start + t - 1} exceed the KV cache of {self.max_len}")
        device = tokens.device
        if positions is None:
            ropes = [(cos[start : start + t], sin[start : start + t]) for cos, sin in self.tables]  # [T, R]
        else:
            ropes = [(cos[positions], sin[positions]) for cos, sin in self.tables]
        if mask is None and t > 1:  # new token i sees every cached position and the new ones up to itself
            mask = torch.ones(t, start + t, dtype=torch.bool, device=device).tril(diagonal=start)

        def query_and_key_positions() -> tuple[Tensor, Tensor]:
            if positions is None:
                return torch.arange(start, start + t, device=device), torch.arange(start + t, device=device)
            return positions, torch.cat([torch.arange(start, device=device), positions])

        masks = self.layer_masks(mask, start + t, query_and_key_positions)
        taps = () if isinstance(return_hidden, bool) else return_hidden
        tapped = []
        x = self.embed(tokens.view(1, t))  # [1, T, D]
        for i, layer in enumerate(self.layers):
            cos, sin = ropes[self.layer_rope[i]]
            x = layer(x, start, cos, sin, masks[self.args.window(i)])
            if i in taps:
                tapped.append(x[0])
        hidden = self.norm(x)[0]  # [T, D]
        logits = self.logits(hidden)  # [T, V]
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
                p.fill_(1.0 - model.args.norm_offset)  # Gemma norms apply 1 + w
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
            if "wo" in name or "w2" in name:
                p.mul_(1.0 / math.sqrt(2 * model.args.n_layers))
