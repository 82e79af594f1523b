"""One K range: the stage's limits (torch-free) and the engine's own constants agree, and the rollups keep every
position a policy may use."""

from __future__ import annotations

from speculation import engine, limits
from speculation.models import StageRollup
from speculation.selectors import rollup_store


def test_the_engine_and_the_stage_accept_the_same_k_range():
    assert (engine.K_MIN, engine.K_MAX) == (limits.K_MIN, limits.K_MAX)


def test_rollups_have_a_column_for_every_draft_position_and_accepted_length_up_to_k_max():
    # given the largest K a policy may use, when a record is rolled up, then no position is dropped
    fields = {f.name for f in StageRollup._meta.get_fields()}
    assert {f"p{i}" for i in range(1, limits.K_MAX + 1)} <= fields
    assert {f"h{i}" for i in range(limits.K_MAX + 1)} <= fields
    assert {f"p{i}" for i in range(1, limits.K_MAX + 1)} <= set(rollup_store.COLUMNS)
