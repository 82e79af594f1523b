"""Limits of the speculation stage, torch-free so the web process, the worker and the REST layer share them.

Standard library only: the engine imports it too (tests/speculation/engine/test_engine_imports.py keeps the
engine's imports to torch, the standard library and such stdlib-only modules of the stage).
"""

from __future__ import annotations

K_MIN, K_MAX = 1, 16  # lookahead K: draft tokens proposed per verification step
DEFAULT_K = 5  # a new policy's K, and the engine's when none is given

# EAGLE-2 draft trees (speculation.engine.tree): children per expanded node, levels, draft nodes per target pass.
TREE_TOP_K_MAX = 8
TREE_DEPTH_MAX = K_MAX
TREE_NODES_MAX = 64
TREE_FIELDS = ("top_k", "depth", "nodes", "score_temperature")


def tree_expansion(top_k: int, levels: int) -> int:
    """Candidates an EAGLE-2 expansion scores over ``levels`` levels: top_k at the first, then top_k children of
    each of the top_k kept nodes per level (top_k + (levels - 1) x top_k^2)."""
    return top_k + (levels - 1) * top_k**2


def tree_nodes_at(top_k: int, depth: int, nodes: int, k: int) -> int:
    """Draft nodes one verification of a tree checks when it is drafted at lookahead K: the expansion to depth
    min(depth, K) keeps the best ``nodes`` of its candidates."""
    return min(nodes, tree_expansion(top_k, max(1, min(depth, k))))


def tree_shape_problems(value: object) -> list[str]:
    """Why a policy's ``eagle_tree`` is not a draft-tree shape ([] when it is; {} or None means a chain).

    A shape is {"top_k", "depth", "nodes"} integers, plus an optional "score_temperature" > 0 (the
    expansion's sharpening, engine.tree.TreeShape). The same ranges as the engine's TreeShape.
    """
    if value in (None, {}):
        return []
    if not isinstance(value, dict):
        return ['eagle_tree must be an object {"top_k", "depth", "nodes"} (or {} for a chain)']
    problems = [f"eagle_tree has an unknown field {name!r}" for name in value if name not in TREE_FIELDS]
    for name, high in (("top_k", TREE_TOP_K_MAX), ("depth", TREE_DEPTH_MAX), ("nodes", TREE_NODES_MAX)):
        found = value.get(name)
        if found is None:
            problems.append(f"eagle_tree needs {name} (an integer in [1, {high}])")
        elif isinstance(found, bool) or not isinstance(found, int) or not 1 <= found <= high:
            problems.append(f"eagle_tree {name} must be an integer in [1, {high}], got {found!r}")
    temperature = value.get("score_temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 < temperature <= 10:
        problems.append(f"eagle_tree score_temperature must be a number in (0, 10], got {temperature!r}")
    expanded = tree_expansion(value["top_k"], value["depth"]) if not problems else 0
    if not problems and value["nodes"] > expanded:
        problems.append(
            f"eagle_tree nodes ({value['nodes']}) exceeds what top_k {value['top_k']} and depth {value['depth']} "
            f"expand ({expanded})"
        )
    return problems
