"""A Transformer's weights run over many requests at once: one KV-cache row per slot, each at its own position.

The batch-1 ``Transformer`` keeps one cache inside the model. Here the same weights (read only, so other users
of the model are undisturbed) run over a separate cache of ``rows`` rows: row r holds slot r's positions, and
one forward takes ``tokens [B, T]`` at positions ``starts[b] .. starts[b] + T - 1`` of rows 0..B-1. Slots feed
different numbers of tokens; the shorter ones are padded. A padded token writes its key and value past its
slot's end, where nothing reads it (query t of row b sees keys 0..starts[b] + t) and the next real token
overwrites it, so each row is exactly its own request. Rolling back is moving a slot's start, as in model.py.

The cache grows (rows and positions, doubling) as slots and lengths need it, so memory follows the load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from speculation.engine.model import Block, Transformer, apply_rope, rope_tables
from speculation.limits import K_MAX

HEADROOM = K_MAX + 2  # positions past max_len that a padded token of a full row may write to
MIN_POSITIONS = 64


class BatchedModel:
    """``model``'s weights over a growable cache [rows, Hkv, positions, D] per layer (its own, not the model's)."""

    def __init__(self, model: Transformer, *, max_rows: int, max_len: int | None = None) -> None:
        args = model.args
        self.model = model
        self.max_rows = max_rows  # growth by doubling stops here
        self.max_len = min(max_len or args.max_positions, args.max_positions)
        param = model.output.weight
        self.device, self.dtype = param.device, param.dtype
        cos, sin = rope_tables(args, self.device)
        self._cos, self._sin = cos.to(self.dtype), sin.to(self.dtype)  # [max_positions, D]
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.rows = self.positions = 0

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @torch.inference_mode()
    def reserve(self, rows: int, positions: int) -> None:
        """Make room for rows 0..rows-1 and positions 0..positions-1 (+ headroom), keeping what is cached."""
        positions = min(positions, self.max_len) + HEADROOM
        if rows <= self.rows and positions <= self.positions:
            return
        new_rows = self.rows if rows <= self.rows else min(max(rows, 2 * self.rows), max(rows, self.max_rows))
        new_positions = self.positions
        if positions > self.positions:
            new_positions = min(max(positions, 2 * self.positions, MIN_POSITIONS), self.max_len + HEADROOM)
        a = self.model.args
        shape = (new_rows, a.n_kv_heads, new_positions, a.head_dim)  # [R, Hkv, S, D]

        def grown(old: Tensor | None) -> Tensor:
            new = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old is not None:
                new[: old.shape[0], :, : old.shape[2]] = old
            return new

        self.k = [grown(self.k[i] if self.k else None) for i in range(a.n_layers)]
        self.v = [grown(self.v[i] if self.v else None) for i in range(a.n_layers)]
        self.rows, self.positions = new_rows, new_positions

    @torch.inference_mode()
    def move_row(self, source: int, dest: int, length: int) -> None:
        """Copy row source's first ``length`` positions to row dest (compacting after a slot leaves)."""
        for store in (self.k, self.v):
            for cache in store:
                cache[dest, :, :length] = cache[source, :, :length]

    @torch.inference_mode()
    def forward(
        self, tokens: Tensor, starts: list[int], *, first_row: int = 0, last: list[int] | None = None
    ) -> Tensor:
        """tokens [B, T] at positions starts[b] + t of rows first_row.. -> logits [B, T, V] float32.

        ``last`` (each row's last real token, host ints like starts): only those positions' logits, [B, V].
        """
        bsz, t = tokens.shape
        rows = slice(first_row, first_row + bsz)
        length = max(starts) + t  # keys 0..length-1 are read
        pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(t, device=self.device)  # [B, T]
        rope_pos = pos.clamp_max(self._cos.shape[0] - 1)  # padded positions past the table are never read
        cos, sin = self._cos[rope_pos][:, None], self._sin[rope_pos][:, None]  # [B, 1, T, D]
        mask = torch.arange(length, device=self.device) <= pos[:, None, :, None]  # [B, 1, T, L]
        x = self.model.tok_embeddings(tokens)  # [B, T, D]
        for i, layer in enumerate(self.model.layers):
            x = self._block(layer, i, x, rows, pos, cos, sin, mask, length)
        if last is not None:
            x = x[torch.arange(bsz, device=self.device), torch.tensor(last, device=self.device)][:, None]  # [B, 1, D]
        logits = self.model.output(self.model.norm(x)).float()  # [B, T or 1, V]
        return logits[:, 0] if last is not None else logits

    def _block(
        self,
        layer: Block,
        i: int,
        x: Tensor,
        rows: slice,
        pos: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        length: int,
    ) -> Tensor:
        h = x + self._attention(layer, i, layer.attention_norm(x), rows, pos, cos, sin, mask, length)
        return h + layer.feed_forward(layer.ffn_norm(h))

    def _attention(
        self,
        layer: Block,
        i: int,
        x: Tensor,
        rows: slice,
        pos: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        length: int,
    ) -> Tensor:
        a, attn = self.model.args, layer.attention
        bsz, t, _ = x.shape
        kv_dim = a.n_kv_heads * a.head_dim
        q, k, v = attn.wqkv(x).split([a.dim, kv_dim, kv_dim], dim=-1)
        q = q.view(bsz, t, a.n_heads, a.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(bsz, t, a.n_kv_heads, a.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(bsz, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        index = pos[:, None, :, None].expand(bsz, a.n_kv_heads, t, a.head_dim)
        cache_k, cache_v = self.k[i][rows], self.v[i][rows]  # views of this batch's rows
        cache_k.scatter_(2, index, k)
        cache_v.scatter_(2, index, v)
        keys, values = cache_k[:, :, :length], cache_v[:, :, :length]  # [B, Hkv, L, D]
        if a.n_kv_heads != a.n_heads:
            keys = keys.repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
            values = values.repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, H, T, D]
        return attn.wo(y.transpose(1, 2).reshape(bsz, t, a.dim))
