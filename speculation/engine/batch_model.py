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

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from speculation.engine.rope import rope_tables_of
from speculation.limits import K_MAX

if TYPE_CHECKING:
    from speculation.engine.model import Block, Transformer

HEADROOM = K_MAX + 2  # positions past max_len that a padded token of a full row may write to
MIN_POSITIONS = 64


# What a forward returns as features: False none, True the final-norm output [T, D] (EAGLE-1's feature), or a
# tuple of layer indices: those layers' outputs and the final-norm output concatenated, [T, (n + 1) * D] (EAGLE-3's
# low / mid / high features).
HiddenRequest = bool | tuple[int, ...]


@dataclass
class ForwardOutput:
    logits: Tensor  # [T, V] float32
    hidden: Tensor | None  # [T, D] or [T, (n + 1) * D]: the features asked for (HiddenRequest)


class BatchedModel:
    """``model``'s weights over a growable cache [rows, Hkv, positions, D] per layer (its own, not the model's)."""

    def __init__(self, model: Transformer, *, max_rows: int, max_len: int | None = None) -> None:
        args = model.args
        self.model = model
        self.max_rows = max_rows  # growth by doubling stops here
        self.max_len = min(max_len or args.max_positions, args.max_positions)
        param = model.output.weight
        self.device, self.dtype = param.device, param.dtype
        self.tables = rope_tables_of(args, self.device, self.dtype)  # per rope table: cos, sin [max_positions, R]
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.rows = self.positions = 0

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def nbytes(self) -> int:
        """The cache's bytes now (it grows with the rows and positions in use)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

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

    def keep(self, row: int, length: int) -> None:
        """Keep row's first ``length`` positions: those past it are overwritten by the next forward."""

    @torch.inference_mode()
    def move_row(self, source: int, dest: int, length: int) -> None:
        """Copy row source's first ``length`` positions to row dest (compacting after a slot leaves)."""
        for store in (self.k, self.v):
            for cache in store:
                cache[dest, :, :length] = cache[source, :, :length]

    @torch.inference_mode()
    def read_row(self, row: int, length: int) -> list[tuple[Tensor, Tensor]]:
        """A copy of row's positions 0..length-1, per layer (keys [Hkv, length, D], values)."""
        return [(k[row, :, :length].clone(), v[row, :, :length].clone()) for k, v in zip(self.k, self.v, strict=True)]

    @torch.inference_mode()
    def write_row(self, row: int, saved: list[tuple[Tensor, Tensor]], length: int) -> None:
        """Positions 0..length-1 of row from what read_row returned (length at most what it read)."""
        for (k, v), cache_k, cache_v in zip(saved, self.k, self.v, strict=True):
            cache_k[row, :, :length] = k[:, :length]
            cache_v[row, :, :length] = v[:, :length]

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        starts: list[int],
        *,
        first_row: int = 0,
        last: list[int] | None = None,
        rows: list[int] | None = None,
    ) -> Tensor:
        """tokens [B, T] at positions starts[b] + t of rows first_row.. -> logits [B, T, V] float32.

        ``last`` (each row's last real token, host ints like starts): only those positions' logits, [B, V].
        ``rows``: the cache rows of the B inputs when they are not first_row..first_row + B - 1 (ascending, B of
        them): a forward over some slots only (a hybrid's draft steps for the slots its lookup did not serve).
        """
        model = self.model
        x, _ = self._layers(tokens, starts, first_row=first_row, rows=rows)
        if last is not None:
            bsz = tokens.shape[0]
            x = x[torch.arange(bsz, device=self.device), torch.tensor(last, device=self.device)][:, None]  # [B, 1, D]
        logits = model.logits(model.norm(x))  # [B, T or 1, V]
        return logits[:, 0] if last is not None else logits

    @torch.inference_mode()
    def forward_row(
        self,
        tokens: Tensor,
        start: int,
        *,
        return_hidden: HiddenRequest = False,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> ForwardOutput:
        """tokens [T] at row 0's positions start.. -> logits [T, V] and the features return_hidden asks for (the
        batch-1 model's forward: model.Transformer runs on this row). A draft tree passes its nodes' RoPE
        ``positions`` [T] and the ``mask`` [T, start + T] of what each node sees; its cache slots stay start.."""
        model = self.model
        taps = () if isinstance(return_hidden, bool) else return_hidden
        self.reserve(1, start + tokens.shape[0])
        x, tapped = self._layers(tokens[None], [start], positions=positions, mask=mask, taps=taps)
        hidden = model.norm(x)[0]  # [T, D]
        logits = model.logits(hidden)  # [T, V]
        if not return_hidden:
            return ForwardOutput(logits=logits, hidden=None)
        return ForwardOutput(logits=logits, hidden=torch.cat([*tapped, hidden], dim=-1) if tapped else hidden)

    @torch.inference_mode()
    def move_positions(self, row: int, source: Tensor, dest: int) -> None:
        """Copy row's positions source [n] to dest..dest+n-1 (a draft tree's accepted path; the source is read
        first)."""
        n = source.shape[0]
        for store in (self.k, self.v):
            for cache in store:
                cache[row, :, dest : dest + n] = cache[row, :, source]

    def _layers(
        self,
        tokens: Tensor,
        starts: list[int],
        *,
        first_row: int = 0,
        rows: list[int] | None = None,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
        taps: tuple[int, ...] = (),
    ) -> tuple[Tensor, list[Tensor]]:
        """The decoder layers over tokens [B, T] -> the last layer's output [B, T, D] (before the final norm) and
        the outputs of the layers in ``taps`` (row 0's, [T, D] each).

        One row (one request in flight, and every draft step of it) takes a shorter way with the same result: its
        cache write is a slice, and a single new token needs no mask (it sees every cached key up to itself).
        """
        bsz, t = tokens.shape
        model = self.model
        index: Tensor | None = None
        if rows is not None:
            if len(rows) != bsz:
                raise ValueError(f"{len(rows)} rows for {bsz} inputs")
            if rows == list(range(rows[0], rows[0] + bsz)):
                first_row = rows[0]  # contiguous: the slice path
            else:
                index = torch.tensor(rows, device=self.device)
        length = max(starts) + t  # keys 0..length-1 are read
        if bsz == 1:
            s = starts[0]
            where: Tensor | int = s
            if positions is None:
                ropes = [(cos[s : s + t], sin[s : s + t]) for cos, sin in self.tables]  # [T, R]
                if mask is None and t > 1:  # one new token sees every cached key: no mask, no positions to build
                    keys = torch.arange(length, device=self.device)
                    mask = keys <= torch.arange(s, s + t, device=self.device)[:, None]  # [T, L]
            else:  # a draft tree: its nodes' own positions, its mask (the caller's)
                ropes = [(cos[positions], sin[positions]) for cos, sin in self.tables]

            def query_and_key_positions() -> tuple[Tensor, Tensor]:  # only for a window shorter than the keys
                if positions is None:
                    return torch.arange(s, s + t, device=self.device), torch.arange(length, device=self.device)
                return positions, torch.cat([torch.arange(s, device=self.device), positions])

        else:
            query_pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(t, device=self.device)
            where = query_pos  # [B, T]
            rope_pos = query_pos.clamp_max(self.tables[0][0].shape[0] - 1)  # padded positions past it are never read
            ropes = [(cos[rope_pos], sin[rope_pos]) for cos, sin in self.tables]  # [B, T, R]
            query_pos = query_pos[:, None]  # [B, 1, T]: the masks broadcast over heads
            keys = torch.arange(length, device=self.device)
            mask = keys <= query_pos[..., None]  # [B, 1, T, L]

            def query_and_key_positions() -> tuple[Tensor, Tensor]:
                return query_pos, keys

        masks = model.layer_masks(mask, length, query_and_key_positions)
        tapped = []
        x = model.embed(tokens)  # [B, T, D]
        for i, layer in enumerate(model.layers):
            cos, sin = ropes[model.layer_rope[i]]
            layer_mask = masks[model.args.window(i)]

            def attention(h: Tensor, i=i, layer=layer, cos=cos, sin=sin, layer_mask=layer_mask) -> Tensor:
                return self._attention(layer, i, h, first_row, where, cos, sin, layer_mask, length, index)

            x = layer.run(x, attention)
            if i in taps:
                tapped.append(x[0])
        return x, tapped

    def _attention(
        self,
        layer: Block,
        i: int,
        x: Tensor,
        first_row: int,
        where: Tensor | int,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        length: int,
        index: Tensor | None = None,
    ) -> Tensor:
        """where: the one row's first position (int), or every row's positions [B, T]. index: the cache rows of
        the B inputs (None: first_row..first_row + B - 1)."""
        a, attn = self.model.args, layer.attention
        bsz, t, _ = x.shape
        kv_heads = a.n_kv_heads
        q, k, v = attn.project(x, cos, sin)  # [B, H, T, D], [B, Hkv, T, D]
        if index is not None:  # rows scattered over the cache: write in place, read a copy of theirs
            full_k, full_v = self.k[i], self.v[i]
            pos = where if isinstance(where, Tensor) else torch.arange(where, where + t, device=self.device)[None]
            full_k[index[:, None], :, pos] = k.transpose(1, 2)  # [B, T, Hkv, D] at (row b, position pos[b, t])
            full_v[index[:, None], :, pos] = v.transpose(1, 2)
            keys, values = full_k[index, :, :length], full_v[index, :, :length]  # [B, Hkv, L, D]
        else:
            rows = slice(first_row, first_row + bsz)
            cache_k, cache_v = self.k[i][rows], self.v[i][rows]  # views of this batch's rows
            if isinstance(where, int):
                cache_k[:, :, where : where + t] = k
                cache_v[:, :, where : where + t] = v
            else:
                scatter = where[:, None, :, None].expand(bsz, kv_heads, t, a.head_dim)
                cache_k.scatter_(2, scatter, k)
                cache_v.scatter_(2, scatter, v)
            keys, values = cache_k[:, :, :length], cache_v[:, :, :length]  # [B, Hkv, L, D]
        return attn.attend(q, keys, values, mask)
