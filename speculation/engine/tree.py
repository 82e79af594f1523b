"""Draft trees: EAGLE-2's dynamic tree (Li et al. 2024, arXiv 2406.16858) verified as in SpecInfer
(Miao et al. 2024, arXiv 2305.09781).

A chain of K drafts loses everything after its first miss; a tree keeps several candidates per position.
The proposer expands the tree by the draft's confidence, the target scores every node in ONE forward pass
with a tree attention mask (a node sees the committed prefix, its ancestors and itself), the longest path
the target accepts is committed, and the KV cache keeps only that path.

Layout: row 0 is the root, the last committed token (the target has not processed it yet); draft nodes are
rows 1..N in topological order (a parent before its children). The target's row r scores the token that
follows row r; a node at depth d sits at position ``start + d``.

- expansion (EAGLE-2): a node's score is the draft's cumulative log-probability along its path. Level 1 is
  the root's ``top_k`` tokens; each later level feeds the previous level's ``top_k`` best-scored nodes
  through the draft and takes ``top_k`` children of each; after ``depth`` levels the ``nodes`` best-scored
  candidates form the tree (a parent always outscores its children, so the set is closed under ancestors).
- greedy verification: a node is accepted when its token is the target's argmax at its parent and its
  parent is accepted. Siblings carry distinct tokens, so the accepted nodes form one path; the target's
  argmax at the path's last node is the recovered token (a child was rejected) or the bonus token (a leaf).
  ``replay_tree_greedy`` does the same against a known output (shadow replay: no target pass).
- sampled verification (multi-draft rejection with deterministic candidates; EAGLE-2's code does the same,
  q = one-hot): at a node whose processed target distribution is p, the children c_1..c_m are tried in
  order and c_j passes with probability p_j(c_j), where p_j is p with c_1..c_{j-1} removed and renormalised
  (the residual of a rejected one-hot draft). The first child that passes is accepted and the walk goes on
  from it; at the node where no child passes, one token is drawn from p with every child removed (at a leaf:
  p itself). Each emitted token is distributed as the target's p given the tokens before it: exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from speculation.engine.errors import SpecDecodeError
from speculation.engine.sampling import SamplingParams, probs_from_logits, suppress_before_min_tokens
from speculation.limits import TREE_DEPTH_MAX, TREE_NODES_MAX, TREE_TOP_K_MAX, tree_expansion

if TYPE_CHECKING:
    from speculation.engine.eagle import EagleDrafter
    from speculation.engine.target import LocalTarget

MAX_TOP_K = TREE_TOP_K_MAX  # children per expanded node
MAX_DEPTH = TREE_DEPTH_MAX  # levels (as lookahead K's K_MAX)
MAX_NODES = TREE_NODES_MAX  # draft nodes verified in one target pass
SCORE_TIE_BREAK = 1e-6  # subtracted per level: a child never ties its parent, so the kept set stays a tree


class TreeShapeError(SpecDecodeError):
    """A draft tree's shape (top_k, depth, nodes) is out of range."""


@dataclass(frozen=True)
class TreeShape:
    """How big a tree the proposer expands: ``top_k`` children per node, ``depth`` levels, ``nodes`` in all."""

    top_k: int = 4
    depth: int = 6
    nodes: int = 24
    # Scores use softmax(logits / score_temperature): below 1 sharpens a draft whose top-1 is right more
    # often than its probability says (an under-confident head), so depth is not traded away for breadth.
    score_temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.score_temperature > 0:
            raise TreeShapeError(f"tree score_temperature must be > 0, got {self.score_temperature!r}")
        for name, value, high in (("top_k", self.top_k, MAX_TOP_K), ("depth", self.depth, MAX_DEPTH),
                                  ("nodes", self.nodes, MAX_NODES)):  # fmt: skip
            if not isinstance(value, int) or not 1 <= value <= high:
                raise TreeShapeError(f"tree {name} must be an integer in [1, {high}], got {value!r}")

    @classmethod
    def from_policy(cls, value: dict | None) -> TreeShape | None:
        """A policy's ``eagle_tree`` ({} or None: a chain, so None) as a shape; TreeShapeError when out of range."""
        if not value:
            return None
        return cls(**{name: value[name] for name in ("top_k", "depth", "nodes", "score_temperature") if name in value})

    @property
    def candidates(self) -> int:
        """Nodes the expansion scores before keeping the best ``nodes``."""
        return tree_expansion(self.top_k, self.depth)


@dataclass
class DraftTree:
    tokens: Tensor  # [N] long: the token of row i + 1
    parents: Tensor  # [N] long: the parent row of row i + 1 (0 = the root), always < i + 1
    depths: Tensor  # [N] long: 1 for the root's children
    ancestors: Tensor  # [N+1, N+1] bool: row r may attend to column c (c is r or an ancestor of r)
    depth: int  # the deepest level (host-side: no device read)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def row_depths(self) -> Tensor:  # [N+1]: 0 for the root
        return torch.cat([self.depths.new_zeros(1), self.depths])

    @classmethod
    def build(cls, tokens: Tensor, parents: Tensor, depths: Tensor, depth: int) -> DraftTree:
        return cls(tokens=tokens, parents=parents, depths=depths, ancestors=ancestor_mask(parents, depth), depth=depth)

    @classmethod
    def chain(cls, tokens: Tensor) -> DraftTree:
        """A chain is the tree whose row i + 1 is the child of row i."""
        n = tokens.shape[0]
        rows = torch.arange(n + 1, device=tokens.device)
        return cls.build(tokens, rows[:-1], rows[1:], n)


def ancestor_mask(parents: Tensor, depth: int) -> Tensor:
    """parents [N] (rows, topological) -> [N+1, N+1] bool: each row sees itself and its ancestors."""
    up = torch.cat([parents.new_zeros(1), parents])  # the root is its own parent
    mask = torch.eye(parents.shape[0] + 1, dtype=torch.bool, device=parents.device)
    for _ in range(depth):  # after t rounds a row holds its ancestors up to t levels up
        mask = mask | mask[up]
    return mask


# --- expansion (EAGLE-2) ---------------------------------------------------------------------------------------


@torch.no_grad()
def expand_eagle_tree(drafter: EagleDrafter, shape: TreeShape) -> DraftTree:
    """Feed the drafter's queued true pairs, then expand a tree by the head's confidence (no device read)."""
    g = drafter.feed_true()[0, 0]  # [H]: the head's feature for the root
    k, true_len, device = shape.top_k, drafter.true_length, g.device
    scale = 1.0 / shape.score_temperature
    scores, tokens = torch.log_softmax(drafter.logits(g).float() * scale, -1).topk(k)  # level 1: [k]
    pool_tokens, pool_scores, pool_parents = [tokens], [scores], [torch.zeros(k, dtype=torch.long, device=device)]
    pool_depths = [torch.ones(k, dtype=torch.long, device=device)]
    feed_rows = torch.arange(1, k + 1, device=device)  # tree rows of the nodes fed next (pool index + 1)
    feed_parent = torch.zeros(k, dtype=torch.long, device=device)  # their parent among fed nodes (level 1: none)
    feed_features = g.expand(k, -1)  # [k, H]: the feature each fed node pairs with its token
    fed_ancestors = torch.zeros(0, 0, dtype=torch.bool, device=device)  # [fed, fed], among fed nodes
    eye = torch.eye(k, dtype=torch.bool, device=device)
    size = k
    for level in range(1, shape.depth):
        fed = fed_ancestors.shape[0]
        above = fed_ancestors[feed_parent] if fed else fed_ancestors.new_zeros(k, 0)  # [k, fed]
        new = torch.cat([above, eye], dim=1)  # [k, fed + k]: what each newly fed node sees of the fed ones
        fed_ancestors = torch.cat([torch.cat([fed_ancestors, fed_ancestors.new_zeros(fed, k)], dim=1), new])
        mask = torch.cat([torch.ones(k, true_len, dtype=torch.bool, device=device), new], dim=1)
        positions = torch.full((k,), true_len + level - 1, device=device)
        embeds = F.embedding(tokens, drafter.embed_weight)  # [k, H]
        out = drafter.head(feed_features[None], embeds[None], true_len + fed, use_cache=True,
                           positions=positions, mask=mask)[0]  # fmt: skip  # [k, H]
        logp = torch.log_softmax(drafter.logits(out).float() * scale, -1)  # [k, V]
        child_scores, child_tokens = logp.topk(k)  # [k, k]
        cand_scores, cand_tokens = (scores[:, None] + child_scores).flatten(), child_tokens.flatten()  # [k*k]
        pool_tokens.append(cand_tokens)
        pool_scores.append(cand_scores)
        pool_parents.append(feed_rows.repeat_interleave(k))
        pool_depths.append(torch.full((k * k,), level + 1, device=device))
        scores, best = cand_scores.topk(k)  # the next level's fed nodes
        tokens, feed_rows = cand_tokens[best], size + 1 + best
        feed_parent, feed_features = fed + best // k, out[best // k]
        size += k * k
    return _keep_best(pool_tokens, pool_scores, pool_parents, pool_depths, shape)


def _keep_best(pool_tokens, pool_scores, pool_parents, pool_depths, shape: TreeShape) -> DraftTree:
    tokens, parents, depths = torch.cat(pool_tokens), torch.cat(pool_parents), torch.cat(pool_depths)
    scores = torch.cat(pool_scores).double() - SCORE_TIE_BREAK * depths  # double: the tie-break stays visible
    keep = scores.topk(min(shape.nodes, scores.shape[0])).indices.sort().values  # pool order is topological
    new_row = torch.zeros(tokens.shape[0] + 1, dtype=torch.long, device=tokens.device)
    new_row[keep + 1] = torch.arange(1, keep.shape[0] + 1, device=tokens.device)
    return DraftTree.build(tokens[keep], new_row[parents[keep]], depths[keep], shape.depth)


# --- verification ----------------------------------------------------------------------------------------------


def verify_tree_greedy(tree: DraftTree, target_logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """target_logits [N+1, V] -> (num_accepted [], path rows [N+1], tokens [N+1]).

    rows[: num_accepted + 1] is the accepted path from the root; tokens[:num_accepted] are its draft tokens
    and tokens[num_accepted] the recovered or bonus token.
    """
    best = target_logits.argmax(-1)  # [N+1]
    num_accepted, last, rows = _accepted_path(tree, tree.tokens == best[tree.parents])
    return num_accepted, rows, _emitted(tree, num_accepted, rows, best.index_select(0, last))


def verify_tree_sampled(tree: DraftTree, p: Tensor, generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """p [N+1, V] the target's processed distributions -> as verify_tree_greedy."""
    n = tree.size
    p_token = p[tree.parents].gather(-1, tree.tokens[:, None]).squeeze(-1)  # [N]: p at the parent of each node
    order = torch.arange(n, device=p.device)
    earlier_sibling = (tree.parents[:, None] == tree.parents[None, :]) & (order[None, :] < order[:, None])  # [N, N]
    mass_before = earlier_sibling.to(p.dtype) @ p_token  # removed by the siblings tried before
    u = torch.rand(n, generator=generator, device=p.device)
    passes = u * (1.0 - mass_before) < p_token  # u < p(c) / (1 - mass before), without dividing
    first = passes & ~(earlier_sibling & passes[None, :]).any(-1)  # the first sibling that passes
    num_accepted, last, rows = _accepted_path(tree, first)
    children = (tree.parents == last).to(p.dtype)  # [N]: the rows tried (and rejected) at the last node
    removed = torch.zeros(p.shape[-1], dtype=p.dtype, device=p.device).scatter_add(0, tree.tokens, children) > 0
    p_last = p.index_select(0, last)  # [1, V]
    residual = p_last.masked_fill(removed, 0.0)
    mass = residual.sum()
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_last)  # all mass on children: unreachable
    final = torch.multinomial(residual, 1, generator=generator).view(1)
    return num_accepted, rows, _emitted(tree, num_accepted, rows, final)


def replay_tree_greedy(tree: DraftTree, known: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy verification of a tree against a KNOWN output (shadow replay: no target pass).

    known [n]: the tokens the target produced after the root, in order. A greedy target's argmax after a
    node at depth d on the output's path is known[d], so a node passes when its token is known[depth - 1] and
    its parent passes: the same (num_accepted, rows, tokens) as verify_tree_greedy over the target's logits.
    Rows deeper than the output never pass; the emitted token after the path is known[num_accepted] (-1 when
    the output has ended there: the replay stops at its end).
    """
    depths = tree.row_depths  # [N+1]
    padded = torch.cat([known.to(depths.device), known.new_full((tree.depth + 1,), -1).to(depths.device)])
    after = padded[depths]  # [N+1]: the target's token after each row, were the row on the output's path
    num_accepted, last, rows = _accepted_path(tree, tree.tokens == after[tree.parents])
    return num_accepted, rows, _emitted(tree, num_accepted, rows, after.index_select(0, last))


def _accepted_path(tree: DraftTree, passes: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """passes [N] -> (num_accepted [], the path's last row [1], rows with the path first, in depth order)."""
    ok = torch.cat([passes.new_ones(1), passes])  # [N+1]: the root is committed
    on_path = ~(tree.ancestors & ~ok[None, :]).any(-1)  # the row and all its ancestors pass
    depth = tree.row_depths
    last = torch.where(on_path, depth, -1).argmax().view(1)
    rows = torch.arange(tree.size + 1, device=passes.device)
    path = tree.ancestors.index_select(0, last)[0]  # [N+1]: the last row and its ancestors
    order = torch.where(path, rows, rows + tree.size + 1).argsort()  # path rows first, in depth order
    return depth.index_select(0, last)[0], last, order


def _emitted(tree: DraftTree, num_accepted: Tensor, rows: Tensor, final: Tensor) -> Tensor:
    row_tokens = torch.cat([tree.tokens.new_zeros(1), tree.tokens])
    path = torch.cat([row_tokens[rows[1:]], row_tokens.new_zeros(1)])  # [N+1]
    return torch.where(torch.arange(tree.size + 1, device=rows.device) < num_accepted, path, final)


# --- one verification step against a target in this process ----------------------------------------------------


@dataclass
class TreeStep:
    num_accepted: int
    tokens: list[int]  # the accepted drafts, then the recovered or bonus token
    hidden: Tensor | None  # [num_accepted + 1, D or (n + 1) * D]: the target's features along the path (EAGLE)


def verify_tree_step(
    target: LocalTarget,
    last_token: int,
    tree: DraftTree,
    params: SamplingParams,
    generator: torch.Generator | None,
    *,
    produced: int = 0,
    min_tokens: int = 0,
    suppress: Tensor | None = None,
    return_hidden: bool | tuple[int, ...] = False,
) -> TreeStep:
    """Score [last committed, tree] in one target pass, verify, and keep only the accepted path cached.

    The target holds every committed token but the last (``length == committed - 1``) before and after, as
    in the chain step. ``produced``, ``min_tokens`` and ``suppress``: vLLM's min_tokens, as in the chain step
    (a row at depth d picks output token produced + d).
    """
    replay = getattr(target, "replay_tree_step", None)
    if replay is not None:  # shadow replay (engine.replay.ReplayTarget): the known output decides, no target pass
        return replay(tree, params, return_hidden=return_hidden)
    model = getattr(target, "model", None)
    if model is None:
        raise SpecDecodeError("draft trees are verified by a target in this process (LocalTarget)")
    start, n, device = target.length, tree.size + 1, target.device
    tokens = torch.cat([torch.tensor([last_token], device=device), tree.tokens.to(device)])  # [N+1]
    mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=device), tree.ancestors.to(device)], dim=1)
    with torch.inference_mode():
        out = model(tokens, start, return_hidden=return_hidden, positions=start + tree.row_depths.to(device), mask=mask)
    logits = suppress_before_min_tokens(out.logits, produced, min_tokens, suppress, tree.row_depths.to(device))
    if params.greedy:
        num_accepted, rows, emitted = verify_tree_greedy(tree, logits)
    else:
        num_accepted, rows, emitted = verify_tree_sampled(tree, probs_from_logits(logits, params), generator)
    step = torch.cat([num_accepted.view(1), rows, emitted]).tolist()  # the one device read of the step
    accepted = step[0]
    path = step[1 : accepted + 2]
    if path[1:] != list(range(1, accepted + 1)):  # the path is not already at start + 1, start + 2, ...
        model.keep_cache_slots(torch.tensor(path[1:], device=device) + start, start + 1)
    target.length = start + accepted + 1
    hidden = out.hidden[torch.tensor(path, device=device)] if out.hidden is not None else None
    return TreeStep(num_accepted=accepted, tokens=step[n + 1 : n + accepted + 2], hidden=hidden)
