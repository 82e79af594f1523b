"""bench_gateway's `concurrency` and `shadow_vs_prod`: the JSON shape, computed from the measured runs."""

from __future__ import annotations

from collections import Counter

import pytest

from speculation.bench.concurrency import SPLIT_KEYS, Run, merge, reason_key, shadow_vs_prod, shape


def _runs(tok_s: float, outcomes: dict | None = None, ids: list | None = None) -> dict:
    return {
        kind: {
            c: Run(
                tok_s=tok_s * int(c),
                latencies_s=[0.1 * i for i in range(1, 11)],
                outcomes=Counter(outcomes or {}),
                token_ids=ids or [[1, 2], [3]],
            )
            for c in ("1", "8", "32")
        }
        for kind in ("greedy", "sampled")
    }


def test_the_report_has_the_issue_shape_with_ratios_over_off_and_over_the_same_path_at_k_0():
    prod = _runs(3.0, {"speculated": 30, "fell_back": 2})
    prod["greedy"]["8"].token_ids = [[1, 2], [4]]  # one greedy answer differs from off
    report = shape({"off": _runs(2.0), "prod": prod, "plain": _runs(2.5, {"speculated": 31, "fell_back": 1})})

    assert set(report) == {"greedy", "sampled"}
    for kind in report:
        assert set(report[kind]) == {"1", "8", "32"}
    row = report["sampled"]["32"]
    assert row["prod_over_off"] == pytest.approx(1.5)
    assert row["prod_over_plain_same_path"] == pytest.approx(1.2)
    assert row["plain_fell_back"] == 1  # a K = 0 request that fell back ran on the server: the ratio says less
    assert (row["speculated"], row["skipped"], row["fell_back"]) == (30, 0, 2)
    assert (row["p50_ms"], row["p99_ms"]) == (500.0, 1000.0)  # quantiles of prod's per-request latencies
    assert row["tok_s"] == {"off": 64.0, "prod": 96.0, "plain": 80.0}
    assert report["greedy"]["8"]["identical_to_off"] == "1 of 2"
    assert report["greedy"]["1"]["identical_to_off"] == "2 of 2"
    assert "identical_to_off" not in row  # sampled outputs are not expected to equal off's


def test_a_zero_rate_gives_no_ratio_rather_than_a_division_error():
    report = shape({"off": _runs(0.0), "prod": _runs(1.0), "plain": _runs(0.0)})
    assert report["greedy"]["1"]["prod_over_off"] is None
    assert report["greedy"]["1"]["prod_over_plain_same_path"] is None


def test_shadow_vs_prod_is_the_median_ratio_over_requests_both_measured_paired_in_order():
    shadow = [{"id": 3, "multiplier": 3.0}, {"id": 1, "multiplier": 2.0}, {"id": 2, "multiplier": None}]
    prod = [{"id": 11, "multiplier": 2.0}, {"id": 12, "multiplier": 4.0}, {"id": 13, "multiplier": 2.0}]

    result = shadow_vs_prod(shadow, prod)

    # pairs in id order: (2.0, 2.0), (None, 4.0) dropped, (3.0, 2.0) -> ratios 1.0 and 1.5
    assert result["requests"] == 2
    assert result["median_ratio"] == pytest.approx(1.25)
    assert (result["shadow_median"], result["prod_median"]) == (2.5, 2.0)


def test_shadow_vs_prod_without_pairs_reports_none():
    assert shadow_vs_prod([], [{"id": 1, "multiplier": 2.0}]) == {
        "median_ratio": None,
        "requests": 0,
        "shadow_median": None,
        "prod_median": None,
        **dict.fromkeys(SPLIT_KEYS),
    }


def test_shadow_vs_prod_splits_the_ratio_into_tokens_worker_and_plain_sides_whose_product_is_the_ratio():
    # shadow: 3 tokens per step, projected over a 10 ms server step at 2.0x -> a projected worker step of 15 ms;
    # prod: 30 tokens in 12 steps at 50 tok/s (a 50 ms step measured), over the same 10 ms step -> 0.5x
    shadow = [{"id": 1, "multiplier": 2.0, "mean_accepted_len": 3.0, "server_step_ms": 10.0}]
    prod = [
        {"id": 2, "multiplier": 0.5, "tok_s": 50.0, "output_tokens": 30, "target_passes": 12, "server_step_ms": 10.0}
    ]

    result = shadow_vs_prod(shadow, prod)

    assert result["projected_worker_step_ms"] == pytest.approx(15.0)
    assert result["prod_worker_step_ms"] == pytest.approx(50.0)
    assert result["worker_side"] == pytest.approx(50.0 / 15.0, abs=1e-4)
    assert result["tokens_side"] == pytest.approx(3.0 / 2.5)
    assert result["plain_side"] == 1.0  # the same stored step on both sides
    product = result["worker_side"] * result["tokens_side"] * result["plain_side"]
    assert product == pytest.approx(result["median_ratio"], rel=1e-3) and result["median_ratio"] == 4.0


def test_the_projected_step_is_read_with_the_tokens_per_pass_the_projection_divided():
    # shadow's replay: 48 tokens in 14 passes (its last steps drafted less: 3.43 a pass) where its drafting steps
    # averaged 3.6 accepted; prod ran the same 48 tokens in 14 passes: the tokens side is 1, not 3.6 / 3.43
    shadow = [{"id": 1, "multiplier": 2.0, "mean_accepted_len": 3.6, "server_step_ms": 10.0}]
    shadow[0].update(output_tokens=48, target_passes=14)
    prod = [{"id": 2, "multiplier": 1.6, "output_tokens": 48, "target_passes": 14, "server_step_ms": 10.0}]
    result = shadow_vs_prod(shadow, prod)
    assert result["tokens_side"] == 1.0
    assert result["projected_worker_step_ms"] == pytest.approx(48 / 14 * 10.0 / 2.0, abs=1e-4)
    assert result["worker_side"] == pytest.approx(result["median_ratio"], abs=1e-4)


def test_a_prod_record_over_the_end_to_end_baseline_has_no_plain_side():
    shadow = [{"id": 1, "multiplier": 2.0, "mean_accepted_len": 3.0, "server_step_ms": 10.0}]
    prod = [{"id": 2, "multiplier": 0.5, "tok_s": 50.0, "output_tokens": 30, "target_passes": 12}]
    assert shadow_vs_prod(shadow, prod)["plain_side"] is None


def test_rounds_merge_into_one_rate_and_the_report_shows_each_round_and_the_last():
    def rounds(rates: list[float], guard: list[int]) -> Run:
        return merge(
            [
                Run(
                    tok_s=rate,
                    latencies_s=[1.0],
                    outcomes=Counter({"speculated": 4 - g, "skipped": g}),
                    token_ids=[[1]],
                    tokens=int(rate * 2),
                    wall_s=2.0,
                    guard_skipped=g,
                )
                for rate, g in zip(rates, guard, strict=True)
            ]
        )

    prod = rounds([50.0, 100.0, 150.0], [0, 3, 4])
    off = rounds([100.0, 100.0, 100.0], [0, 0, 0])
    measured = {
        phase: {kind: {c: run for c in ("1", "8", "32")} for kind in ("greedy", "sampled")}
        for phase, run in (("off", off), ("prod", prod), ("plain", off))
    }

    row = shape(measured)["greedy"]["8"]

    assert prod.tok_s == pytest.approx(100.0) and prod.tokens == 600 and prod.wall_s == 6.0
    assert row["prod_over_off"] == pytest.approx(1.0)
    assert row["prod_over_off_per_round"] == [0.5, 1.0, 1.5] and row["prod_over_off_last_round"] == 1.5
    assert row["prod_over_off_median_round"] == 1.0
    # the mean of the rounds' ratios, with Student's t at 2 degrees of freedom (2.920 x sd 0.5 / sqrt 3)
    assert row["prod_over_off_mean_round"] == 1.0
    assert row["prod_over_off_interval_90"] == [0.1571, 1.8429]
    assert row["guard_skipped"] == 7 and row["guard_skipped_per_round"] == [0, 3, 4]
    assert (row["speculated"], row["skipped"]) == (5, 7)
    assert row["speculated_per_round"] == [4, 1, 0]


def test_the_report_counts_why_each_prod_request_speculated_or_went_plain_per_round_and_in_all():
    slower = "speculation measured slower than plain at this load (goodput guard)"
    records = [
        {"action": "speculated", "reason": "goodput guard: learning load 5-16"},
        {"action": "skipped", "reason": f"{slower}: median 10.0 vs 50.0 tok/s per request over the last 4 / 8"},
        {"action": "skipped", "reason": f"{slower}: median 9.0 vs 51.0 tok/s per request over the last 5 / 8"},
        {"action": "speculated", "reason": ""},
    ]
    first = Run(tok_s=1.0, latencies_s=[1.0], reasons=Counter(reason_key(r) for r in records[:2]), wall_s=1.0)
    second = Run(tok_s=1.0, latencies_s=[1.0], reasons=Counter(reason_key(r) for r in records[2:]), wall_s=1.0)
    prod = merge([first, second])
    off = merge([Run(tok_s=1.0, latencies_s=[1.0], wall_s=1.0)] * 2)
    measured = {
        phase: {kind: {c: run for c in ("1", "8", "32")} for kind in ("greedy", "sampled")}
        for phase, run in (("off", off), ("prod", prod), ("plain", off))
    }

    row = shape(measured)["sampled"]["32"]

    # the figures that differ per request are cut, so one reason counts once however its medians read
    assert row["reasons"] == {
        f"skipped: {slower}": 2,
        "speculated: goodput guard: learning load 5-16": 1,
        "speculated": 1,
    }
    assert row["reasons_per_round"] == [
        {"speculated: goodput guard: learning load 5-16": 1, f"skipped: {slower}": 1},
        {f"skipped: {slower}": 1, "speculated": 1},
    ]


def test_off_and_prod_take_turns_going_first_after_offs_warm_up_round(monkeypatch):
    from types import SimpleNamespace

    from speculation.bench import concurrency

    order: list[tuple[str, int, str]] = []  # (mode set, concurrency, kind) of each measured round, in order
    state = {"mode": ""}

    def run_once(stack, prompts, *, concurrency, max_tokens, sampling, prod, endpoint="demo"):
        assert prod == (state["mode"] != "off")
        if (len(prompts) > 1 or concurrency > 1) and not state.get("k0"):  # not a warm-up, not the K = 0 phase
            order.append((state["mode"], concurrency, "greedy" if sampling == {"temperature": 0.0} else "sampled"))
        return Run(tok_s=1.0, latencies_s=[1.0], tokens=1, wall_s=1.0)

    stack = SimpleNamespace(
        set_policy=lambda name, **fields: state.update(mode=fields["mode"]),
        set_demo_pairing=lambda **_: state.update(mode="prod"),
        restart_worker=lambda **_: state.update(k0=True),
        restart_ace=lambda **_: None,
        target_dir="/nowhere",
    )
    monkeypatch.setattr(concurrency, "run_once", run_once)

    settled: list[int] = []  # rounds measured before each wait
    measured = concurrency.run_all(
        stack,
        ["a", "b"],
        requests={1: 2, 8: 8, 32: 32},
        max_tokens=4,
        log=lambda _: None,
        rounds=4,
        wait=lambda: settled.append(len(order)),
    )

    assert settled == [3 * 8]  # once, where the load drops: after greedy at 32, before sampled at 1
    greedy_8 = [m for m, c, k in order if c == 8 and k == "greedy"]
    assert greedy_8 == ["off", "prod", "prod", "off", "off", "prod", "prod", "off"]
    assert len(measured["off"]["sampled"]["32"].rounds) == 4 and len(measured["prod"]["greedy"]["1"].rounds) == 4


def test_only_the_loads_asked_for_run(monkeypatch):
    from types import SimpleNamespace

    from speculation.bench import concurrency

    seen: set[int] = set()

    def run_once(stack, prompts, *, concurrency, max_tokens, sampling, prod, endpoint="demo"):
        seen.add(concurrency)
        return Run(tok_s=1.0, latencies_s=[1.0], tokens=1, wall_s=1.0)

    stack = SimpleNamespace(
        set_policy=lambda name, **fields: None,
        set_demo_pairing=lambda **_: None,
        restart_worker=lambda **_: None,
        restart_ace=lambda **_: None,
    )
    monkeypatch.setattr(concurrency, "run_once", run_once)
    measured = concurrency.run_all(
        stack, ["a"], requests={1: 4}, max_tokens=4, log=lambda _: None, rounds=2, loads=(1,), wait=pytest.fail
    )
    assert seen == {1}
    report = shape(measured)
    assert set(report["greedy"]) == set(report["sampled"]) == {"1"}


@pytest.mark.parametrize("text", ["0", "1,x", "", "1,,8", "300", "-1"])
def test_bench_gateway_refuses_loads_that_are_not_stream_counts(text):
    from django.core.management.base import CommandError

    from speculation.management.commands.bench_gateway import _loads

    with pytest.raises(CommandError, match="--concurrency-streams") as raised:
        _loads(text)
    assert raised.value.returncode == 2


def test_bench_gateway_takes_loads_in_order_once_each():
    from speculation.management.commands.bench_gateway import _loads

    assert _loads("1, 8,32,8") == (1, 8, 32)


def test_fresh_prompts_never_repeat_across_rounds_and_loads_and_off_and_prod_share_each_rounds(monkeypatch):
    from types import SimpleNamespace

    from speculation.bench import concurrency

    sent: list[tuple[str, int, tuple[str, ...]]] = []  # (mode, concurrency, prompts) per measured greedy round
    state = {"mode": "", "pairing": None}

    def run_once(stack, prompts, *, concurrency, max_tokens, sampling, prod, endpoint="demo"):
        if (len(prompts) > 1 or concurrency > 1) and sampling == {"temperature": 0.0} and not state.get("k0"):
            sent.append((state["mode"], concurrency, tuple(prompts)))
        return Run(tok_s=1.0, latencies_s=[1.0], tokens=1, wall_s=1.0)

    stack = SimpleNamespace(
        set_policy=lambda name, **fields: state.update(mode=fields["mode"]),
        set_demo_pairing=lambda **fields: state.update(mode="prod", pairing=fields),
        restart_worker=lambda **_: state.update(k0=True),
        restart_ace=lambda **_: None,
    )
    monkeypatch.setattr(concurrency, "run_once", run_once)
    pool = [f"p{i}" for i in range(200)]
    concurrency.run_all(
        stack, pool, requests={1: 4, 8: 16}, max_tokens=4, log=lambda _: None, rounds=3, loads=(1, 8),
        wait=lambda: None, mechanism="suffix", fresh=True,
    )  # fmt: skip
    assert state["pairing"] == {"k": concurrency.PROD_K, "mechanism": "suffix"}
    by_round: dict[tuple[int, int], set[tuple[str, ...]]] = {}
    for i, (_, load, prompts) in enumerate(sent):
        by_round.setdefault((load, i // 2), set()).add(prompts)
    assert all(len(both) == 1 for both in by_round.values())  # off's round and prod's round: the same prompts
    rounds = [next(iter(both)) for both in by_round.values()]
    flat = [p for prompts in rounds for p in prompts]
    assert len(rounds) == 6 and len(flat) == len(set(flat)) == 3 * 4 + 3 * 16  # no prompt twice
