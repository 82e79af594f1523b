"""One decoder-only transformer (gpt-fast style) for every supported family; its KV cache is a row of the batch
engine's cache (batch_model.py), indexed by position.

Rolling back after a rejection is moving the position: entries past it are simply overwritten later.
One forward call takes any number of new tokens at consecutive positions, so a single target pass
verifies K draft tokens plus the bonus position. What differs between Llama, Mistral, Qwen, Gemma and Phi-3
(engine/families.py) is data in ``ModelArgs``: biases, q/k norms, Gemma's norms and soft-capping, sliding windows,
partial rotary and rope scaling. The batch model (batch_model.py) runs these same blocks over its own cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speculation.engine.batch_model import BatchedModel, ForwardOutput, HiddenRequest
from speculation.engine.families import ModelArgs
from speculation.engine.rope import rotate


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


class Transformer(nn.Module):
    """A causal LM's weights. ``forward(tokens, start)`` runs one request on one row of the batch engine's cache
    (batch_model.BatchedModel, growing with the request up to ``max_len``), writing positions start..start+T-1; the
    batch engine runs the same weights over its own rows."""

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
        self._embed_scale: Tensor | None = None
        self._row: BatchedModel | None = None  # this model's own request (forward), made at its first forward

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def setup_cache(self, max_len: int | None = None) -> None:
        """Room for a request of up to max_len positions (the row grows to it as the request does)."""
        max_len = min(max_len or self.args.max_positions, self.args.max_positions)
        param = self.output.weight
        if self.args.embed_scale != 1.0:  # rounded to the weights' dtype, as transformers' scaled embedding
            self._embed_scale = torch.tensor(self.args.embed_scale, dtype=param.dtype, device=param.device)
        self.max_len = max_len
        self._row = None

    @property
    def cache_bytes(self) -> int:
        """The bytes of its own request's cache row now (none before its first forward)."""
        return self._row.nbytes if self._row is not None else 0

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
        if not self.max_len:
            raise RuntimeError("call setup_cache() before forward()")
        t = tokens.shape[-1]
        if start + t > self.max_len:
            raise ValueError(f"positions {start}..{start + t - 1} exceed the KV cache of {self.max_len}")
        if self._row is None:
            self._row = BatchedModel(self, max_rows=1, max_len=self.max_len)
        return self._row.forward_row(tokens, start, return_hidden=return_hidden, positions=positions, mask=mask)

    def _apply(self, fn, *args, **kwargs):  # noqa: ANN001, ANN202 - nn.Module's: .to(), .half(), ...
        self._row = None  # the cache follows the weights: made again, on their device and dtype, when next used
        return super()._apply(fn, *args, **kwargs)

    def keep_cache_slots(self, slots: Tensor, start: int) -> None:
        """Move the cache slots [n] to start..start+n-1 (what a draft tree's accepted path keeps)."""
        if self._row is not None:
            self._row.move_positions(0, slots, start)

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
