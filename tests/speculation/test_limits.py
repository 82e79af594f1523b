"""One K range: the stage's limits (torch-free) and the engine's own constants agree, and the rollups keep every
position a policy may use."""

from __future__ import annotations

from speculation import engine, limits
from speculation.models import SpeculationPolicy, StageRollup
from speculation.selectors import rollup_store


def test_the_engine_and_the_stage_accept_the_same_k_range():
    assert (engine.K_MIN, engine.K_MAX) == (limits.K_MIN, limits.K_MAX)


def test_rollups_have_a_column_for_every_draft_position_and_accepted_length_up_to_k_max():
    # given the largest K a policy may use, when a record is rolled up, then no position is dropped
    fields = {f.name for f in StageRollup._meta.get_fields()}
    assert {f"p{i}" for i in range(1, limits.K_MAX + 1)} <= fields
    assert {f"h{i}" for i in range(limits.K_MAX + 1)} <= fields
    assert {f"p{i}" for i in range(1, limits.K_MAX + 1)} <= set(rollup_store.COLUMNS)


def test_the_tree_expansion_counts_top_k_then_top_k_squared_per_further_level():
    # given top_k 3: 3 candidates at level 1, then 9 more at each further level
    assert [limits.tree_expansion(3, levels) for levels in (1, 2, 4)] == [3, 12, 30]
    # then the engine's shape, the policy check and the verified-node count read the same number
    assert engine.TreeShape(top_k=3, depth=4, nodes=30).candidates == 30
    assert limits.tree_shape_problems({"top_k": 3, "depth": 4, "nodes": 31})[0].endswith("expand (30)")
    assert limits.tree_nodes_at(3, 4, 64, k=2) == 12


def test_a_new_policy_and_the_engine_start_at_the_same_default_k():
    assert SpeculationPolicy._meta.get_field("k").default == limits.DEFAULT_K == engine.DEFAULT_K
