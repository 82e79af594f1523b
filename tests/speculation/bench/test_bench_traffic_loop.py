"""bench_traffic_loop's pure parts: its arguments (bad ones exit 2 before anything starts) and the JSON it writes
from a measurement (stubbed here: the full run starts vLLM and trains a head, never in the suite)."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from speculation.bench import traffic_loop
from speculation.management.commands.bench_traffic_loop import Command, checked_plan


def _stats(mean_accepted_len: float) -> dict:
    return {"k": 5, "alpha": 0.5, "acceptance_rate": 0.4, "mean_accepted_len": mean_accepted_len, "steps": 10}


MEASURED = {
    "run": {"id": 1, "draft": "traffic-loop", "multi_layer": True},
    "held_out_per_workload": {"code": 6, "lists": 6},
    "stats": {
        "shipped": {"all": _stats(1.5), "code": _stats(1.2), "lists": _stats(1.8)},
        "trained": {"all": _stats(1.8), "code": _stats(1.8), "lists": _stats(1.8)},
    },
}


def test_it_exits_2_on_an_unknown_workload_before_starting_anything():
    with pytest.raises(CommandError) as raised:
        call_command("bench_traffic_loop", "--workloads", "code,poetry")
    assert raised.value.returncode == 2
    assert "poetry" in str(raised.value)


def test_it_exits_2_on_a_request_count_that_is_not_positive(capsys):
    with pytest.raises(SystemExit) as raised:
        Command().run_from_argv(["manage.py", "bench_traffic_loop", "--requests", "0"])
    assert raised.value.code == 2


def test_quick_sizes_apply_where_no_size_is_given_and_a_given_one_wins():
    plan = checked_plan({"quick": True, "workloads": "lists,code,lists", "epochs": 7})
    assert plan["workloads"] == ("lists", "code")
    assert (plan["requests"], plan["max_tokens"], plan["epochs"]) == (32, 48, 7)
    assert plan["multi_layer"] is True


def test_the_run_continues_from_the_shipped_head_unless_a_new_head_is_asked_for():
    assert checked_plan({"workloads": "code"})["from_scratch"] is False
    assert checked_plan({"workloads": "code", "from_scratch": True})["from_scratch"] is True
    assert checked_plan({"workloads": "code", "single_layer": True})["from_scratch"] is True  # shipped: multi-layer


def test_the_json_has_the_gain_per_workload_and_prod_over_shadow_from_the_median_ratio():
    result = traffic_loop.shape(MEASURED, prod={"median_ratio": 0.8, "requests": 12})

    assert (result["shipped_mean_accepted_len"], result["trained_mean_accepted_len"]) == (1.5, 1.8)
    assert result["gain"] == 1.2
    assert result["workloads"]["code"]["gain"] == 1.5
    assert result["workloads"]["lists"]["held_out_requests"] == 6
    assert result["prod_over_shadow"] == 1.25
    assert "prod_over_shadow_reason" not in result
    assert "code" in traffic_loop.table(result)


def test_an_unmeasured_prod_is_null_with_its_reason():
    result = traffic_loop.shape(MEASURED, prod={"median_ratio": None, "requests": 0}, prod_reason="none in both")

    assert result["prod_over_shadow"] is None
    assert result["prod_over_shadow_reason"] == "none in both"
    assert "null (none in both)" in traffic_loop.table(result)
