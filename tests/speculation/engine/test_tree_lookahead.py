"""TreeLookahead: the lookahead controller sizes a draft tree's width (its shape among the policy tree's family) as
well as its depth, from measured costs. The controller is fed synthetic measurements (no wall clock); the decode
loop with it stays token-identical to plain greedy decoding."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from speculation.engine import GenerationConfig, LocalTarget, generate, generate_plain
from speculation.engine.eagle import EagleProposer
from speculation.engine.lookahead import SHAPE_PROBE_EVERY, StepReport, TreeLookahead, shape_label, tree_family
from speculation.engine.tree import TreeShape
from tests.speculation.engine.test_engine_tree import PROMPTS, trained_tree_head  # noqa: F401 - a fixture

POLICY_TREE = TreeShape(top_k=2, depth=8, nodes=12, score_temperature=0.3)  # the bench's default tree


def test_the_family_is_the_chain_the_tree_cut_to_half_its_nodes_and_the_tree():
    family = tree_family(POLICY_TREE)

    assert family == (
        TreeShape(top_k=1, depth=8, nodes=8, score_temperature=0.3),
        TreeShape(top_k=2, depth=8, nodes=6, score_temperature=0.3),
        POLICY_TREE,
    )
    assert [shape_label(s) for s in family] == ["chain", "k2-n6", "k2-n12"]
    assert tree_family(TreeShape(top_k=1, depth=5, nodes=5)) == (TreeShape(top_k=1, depth=5, nodes=5),)


def simulate(
    lookahead: TreeLookahead,
    *,
    verify_s: Callable[[int], float],
    level_s: Callable[[int], float],
    reach: dict[str, int],
    steps: int,
) -> list[str]:
    """Feed the controller synthetic steps: a verification of n tokens costs verify_s(n), a draft level with
    top_k rows costs level_s(top_k), and a step with a shape accepts min(depth, reach[shape]) drafts (a fixed,
    deterministic stand-in for the head's acceptance). Returns the shape label (or "plain") of every step."""
    chosen = []
    for _ in range(steps):
        k = lookahead.choose()
        shape = lookahead.shape
        if k == 0:
            lookahead.observe(StepReport(drafted=0, accepted=0, reached=0, draft_s=0.0, verify_s=verify_s(1)))
            chosen.append("plain")
            continue
        depth = min(shape.depth, k)
        nodes = min(shape.nodes, shape.top_k + (depth - 1) * shape.top_k**2)
        accepted = min(depth, reach[shape_label(shape)])
        lookahead.observe(
            StepReport(
                drafted=depth,
                accepted=accepted,
                reached=min(accepted + 1, depth),
                draft_s=depth * level_s(shape.top_k),
                verify_s=verify_s(nodes + 1),
                verified=nodes + 1,
            )
        )
        chosen.append(shape_label(shape))
    return chosen


def test_where_verifying_more_nodes_is_nearly_free_the_controller_converges_to_the_wide_tree():
    # given GPU-like costs: a verification of 13 tokens costs 1.2 % more than one of 1; a draft level costs 5 % of
    # a target step whatever its width; the wide tree's branches keep 5 drafts accepted where the chain keeps 2
    lookahead = TreeLookahead.for_tree(POLICY_TREE, k_max=8, k_start=8)

    chosen = simulate(
        lookahead,
        verify_s=lambda n: 0.010 + 0.00001 * n,
        level_s=lambda top_k: 0.0005,
        reach={"chain": 2, "k2-n6": 3, "k2-n12": 5},
        steps=300,
    )

    # then: after the first steps the wide tree is chosen except for the periodic probes of the other shapes
    # (one step each per SHAPE_PROBE_EVERY drafting steps), so it is most of the last 100 steps
    late = Counter(chosen[-100:])
    assert late.most_common(1)[0][0] == "k2-n12", late
    assert late["k2-n12"] >= 100 - 2 * (100 // SHAPE_PROBE_EVERY + 1) - 1, late
    assert late["chain"] >= 1 and late["k2-n6"] >= 1, late  # the other shapes are still probed


def test_where_each_node_costs_its_price_and_branches_are_rarely_accepted_the_controller_converges_to_the_chain():
    # given CPU-like costs: each extra verified token costs 30 % of a step and a level's cost grows with its rows;
    # the tree's branches are almost never what the target picks (the tree accepts what the chain does)
    lookahead = TreeLookahead.for_tree(POLICY_TREE, k_max=8, k_start=8)

    chosen = simulate(
        lookahead,
        verify_s=lambda n: 0.010 + 0.003 * (n - 1),
        level_s=lambda top_k: 0.0005 * top_k,
        reach={"chain": 4, "k2-n6": 4, "k2-n12": 4},
        steps=300,
    )

    late = Counter(chosen[-100:])
    assert late.most_common(1)[0][0] == "chain", late
    assert late["chain"] >= 100 - 2 * (100 // SHAPE_PROBE_EVERY + 1) - 1, late


def test_a_shape_whose_acceptance_falls_is_left_for_a_narrower_one_and_probed_again():
    # given the wide tree winning, then its acceptance falling to the chain's (the workload changed)
    lookahead = TreeLookahead.for_tree(POLICY_TREE, k_max=8, k_start=8)
    costs = {"verify_s": lambda n: 0.010 + 0.0005 * (n - 1), "level_s": lambda top_k: 0.0005}
    simulate(lookahead, **costs, reach={"chain": 2, "k2-n6": 3, "k2-n12": 6}, steps=200)
    assert lookahead.shape == POLICY_TREE or Counter(lookahead.used).most_common(1)[0][0] == "k2-n12"

    chosen = simulate(lookahead, **costs, reach={"chain": 2, "k2-n6": 2, "k2-n12": 2}, steps=200)

    late = Counter(chosen[-100:])
    assert late.most_common(1)[0][0] in ("chain", "k2-n6"), late  # fewer nodes for the same acceptance
    assert late["k2-n12"] >= 1, late  # still probed


def test_without_a_draft_that_pays_the_controller_decodes_plainly_and_probes():
    lookahead = TreeLookahead.for_tree(POLICY_TREE, k_max=8, k_start=8)

    chosen = simulate(
        lookahead,
        verify_s=lambda n: 0.010 * n,  # every verified token costs a full step
        level_s=lambda top_k: 0.002,
        reach={"chain": 0, "k2-n6": 0, "k2-n12": 0},
        steps=200,
    )

    late = Counter(chosen[-100:])
    assert late["plain"] >= 80, late
    assert late["plain"] < 100, late  # a drafting probe now and then


@pytest.mark.parametrize("tree", [TreeShape(3, 6, 12), TreeShape(2, 8, 12, score_temperature=0.3)], ids=str)
def test_the_dynamic_shape_tree_output_is_token_identical_to_plain_greedy(target_model, trained_tree_head, tree):  # noqa: F811
    # given the decode loop with dynamic K: a tree proposer gets a TreeLookahead, which hands each step's shape
    # (chain, half tree, tree) to the proposer
    local = LocalTarget(target_model)
    proposer = EagleProposer(trained_tree_head, target_model, tree=tree)
    lookahead = TreeLookahead.for_tree(tree, k_max=tree.depth, k_start=tree.depth)
    config = GenerationConfig(max_new_tokens=40, k=tree.depth, dynamic_k=True)

    for prompt in PROMPTS:
        result = generate(local, proposer, prompt, config, lookahead=lookahead)

        assert result.tokens == generate_plain(local, prompt, config).tokens, f"prompt {prompt}"
    assert all(count > 0 for count in lookahead.used.values()), lookahead.used  # every shape of the family ran
    assert proposer.tree == tree  # the policy's shape is the proposer's own still


def test_dynamic_k_gives_a_tree_proposer_a_tree_lookahead(target_model, trained_tree_head):  # noqa: F811
    from speculation.engine.request import default_lookahead

    proposer = EagleProposer(trained_tree_head, target_model, tree=POLICY_TREE)

    lookahead = default_lookahead(proposer, 8)

    assert isinstance(lookahead, TreeLookahead)
    assert [arm.shape for arm in lookahead.arms] == list(tree_family(POLICY_TREE))
    assert not isinstance(default_lookahead(EagleProposer(trained_tree_head, target_model), 5), TreeLookahead)
