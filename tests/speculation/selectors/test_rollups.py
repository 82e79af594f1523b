"""Rollups over known stage records give known numbers (all aggregation happens in the database)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from fleet.models import Endpoint
from speculation.models import Action, Mode, PolicyChange, SpeculationPolicy, StageRecord
from speculation.selectors import rollups

NOW = datetime(2026, 11, 29, 12, 0, 30, tzinfo=UTC)

pytestmark = pytest.mark.django_db


def make_record(endpoint: Endpoint, *, at: datetime, mode: str, action: str, **fields) -> StageRecord:
    record = StageRecord.objects.create(
        endpoint=endpoint, request_id=f"r{at.timestamp()}", mode=mode, action=action, **fields
    )
    StageRecord.objects.filter(pk=record.pk).update(created_at=at)  # created_at is auto_now_add
    return record


@pytest.fixture
def endpoint() -> Endpoint:
    return Endpoint.objects.create(name="llama", base_url="http://127.0.0.1:9/")


def shadow(endpoint: Endpoint, at: datetime, drafted: int, accepted: int, **extra) -> StageRecord:
    return make_record(
        endpoint,
        at=at,
        mode=Mode.SHADOW,
        action=Action.WOULD_SPECULATE,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        **extra,
    )


def prod(endpoint: Endpoint, at: datetime, drafted: int, accepted: int, **extra) -> StageRecord:
    return make_record(
        endpoint,
        at=at,
        mode=Mode.PROD,
        action=Action.SPECULATED,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        **extra,
    )


def test_acceptance_rate_is_token_weighted_per_minute_bucket_and_mode(endpoint):
    # given two shadow records in the 11:58 minute, one in 11:59, and one prod record in 11:59
    shadow(endpoint, datetime(2026, 11, 29, 11, 58, 5, tzinfo=UTC), drafted=10, accepted=5)
    shadow(endpoint, datetime(2026, 11, 29, 11, 58, 55, tzinfo=UTC), drafted=30, accepted=27)
    shadow(endpoint, datetime(2026, 11, 29, 11, 59, 0, tzinfo=UTC), drafted=4, accepted=1)
    prod(endpoint, datetime(2026, 11, 29, 11, 59, 30, tzinfo=UTC), drafted=20, accepted=15)
    # and records that must not count: too old, skipped, nothing drafted
    shadow(endpoint, NOW - timedelta(hours=2), drafted=10, accepted=10)
    make_record(endpoint, at=NOW - timedelta(minutes=1), mode=Mode.PROD, action=Action.SKIPPED, reason="logprobs")
    shadow(endpoint, NOW - timedelta(minutes=1), drafted=0, accepted=0)

    # when
    data = rollups.timeseries(endpoint_id=endpoint.pk, metric="acceptance_rate", range_name="hour", now=NOW)

    # then
    by_name = {s["name"]: s for s in data["series"]}
    assert set(by_name) == {"shadow", "prod"}
    assert by_name["shadow"]["t"] == ["2026-11-29T11:58:00+00:00", "2026-11-29T11:59:00+00:00"]
    assert by_name["shadow"]["y"] == [0.8, 0.25]  # (5 + 27) / (10 + 30), 1 / 4
    assert by_name["shadow"]["n"] == [2, 1]
    assert by_name["prod"]["y"] == [0.75]
    assert data["bucket_seconds"] == 60


def test_day_range_uses_ten_minute_buckets(endpoint):
    shadow(endpoint, datetime(2026, 11, 29, 10, 1, tzinfo=UTC), drafted=10, accepted=2)
    shadow(endpoint, datetime(2026, 11, 29, 10, 9, 59, tzinfo=UTC), drafted=10, accepted=4)
    shadow(endpoint, datetime(2026, 11, 29, 10, 10, tzinfo=UTC), drafted=10, accepted=6)

    data = rollups.timeseries(endpoint_id=endpoint.pk, metric="acceptance_rate", range_name="day", now=NOW)

    (series,) = data["series"]
    assert series["t"] == ["2026-11-29T10:00:00+00:00", "2026-11-29T10:10:00+00:00"]
    assert series["y"] == [0.3, 0.6]


def test_tok_s_series_puts_speculative_next_to_baseline(endpoint):
    at = datetime(2026, 11, 29, 11, 30, 10, tzinfo=UTC)
    prod(endpoint, at, drafted=5, accepted=5, tok_s=30.0, baseline_tok_s=10.0, multiplier=3.0)
    prod(endpoint, at + timedelta(seconds=5), drafted=5, accepted=5, tok_s=20.0, baseline_tok_s=12.0, multiplier=5 / 3)
    # shadow records have no measured tok/s of their own
    shadow(endpoint, at, drafted=5, accepted=1, multiplier=1.2)

    tok = rollups.timeseries(endpoint_id=endpoint.pk, metric="tok_s", range_name="hour", now=NOW)
    mult = rollups.timeseries(endpoint_id=endpoint.pk, metric="multiplier", range_name="hour", now=NOW)

    assert {s["name"]: s["y"] for s in tok["series"]} == {"speculative": [25.0], "baseline": [11.0]}
    assert {s["name"]: s["y"] for s in mult["series"]} == {"prod": [round((3.0 + 5 / 3) / 2, 4)], "shadow": [1.2]}


def test_requests_series_counts_every_action(endpoint):
    at = NOW - timedelta(minutes=3)
    shadow(endpoint, at, drafted=5, accepted=1)
    make_record(endpoint, at=at, mode=Mode.PROD, action=Action.FELL_BACK, reason="worker missing")
    make_record(endpoint, at=at, mode=Mode.PROD, action=Action.FELL_BACK, reason="timeout")

    data = rollups.timeseries(endpoint_id=endpoint.pk, metric="requests", range_name="hour", now=NOW)

    assert {s["name"]: s["y"] for s in data["series"]} == {"fell_back": [2.0], "would_speculate": [1.0]}


def test_policy_changes_in_range_are_change_points_oldest_first(endpoint):
    policy = SpeculationPolicy.objects.create(endpoint=endpoint)
    old = PolicyChange.objects.create(policy=policy, changes={"mode": ["off", "shadow"]})
    first = PolicyChange.objects.create(policy=policy, changes={"mode": ["off", "shadow"]})
    second = PolicyChange.objects.create(policy=policy, changes={"mode": ["shadow", "prod"], "k": [5, 4]})
    PolicyChange.objects.filter(pk=old.pk).update(changed_at=NOW - timedelta(hours=3))
    PolicyChange.objects.filter(pk=first.pk).update(changed_at=NOW - timedelta(minutes=30))
    PolicyChange.objects.filter(pk=second.pk).update(changed_at=NOW - timedelta(minutes=10))

    data = rollups.timeseries(endpoint_id=endpoint.pk, metric="acceptance_rate", range_name="hour", now=NOW)

    assert [p["summary"] for p in data["change_points"]] == ["mode: off -> shadow", "k: 5 -> 4, mode: shadow -> prod"]


def test_per_position_acceptance_pools_record_rates_weighted_by_steps(endpoint):
    at = NOW - timedelta(minutes=5)
    # per-record rates: 4 steps accepting position 1 three times, position 2 once; 6 steps: 6, 3, 3 times
    shadow(endpoint, at, drafted=12, accepted=4, k=3, target_passes=4, per_position_acceptance=[0.75, 0.25, 0.0])
    shadow(endpoint, at, drafted=18, accepted=12, k=3, target_passes=6, per_position_acceptance=[1.0, 0.5, 0.5])
    prod(endpoint, at, drafted=4, accepted=2, k=2, target_passes=2, per_position_acceptance=[1.0, 0.0])

    data = rollups.per_position_acceptance(endpoint_id=endpoint.pk, since=NOW - timedelta(hours=1), until=NOW)

    assert data["shadow"][:4] == [0.9, 0.4, 0.3, None]
    assert data["prod"][:3] == [1.0, 0.0, None]
    assert len(data["shadow"]) == rollups.MAX_K


def test_accepted_length_histogram_sums_lists_index_by_index(endpoint):
    at = NOW - timedelta(minutes=5)
    shadow(endpoint, at, drafted=12, accepted=4, accepted_length_hist=[1, 2, 0, 1])
    shadow(endpoint, at, drafted=12, accepted=4, accepted_length_hist=[0, 1])
    shadow(endpoint, NOW - timedelta(days=2), drafted=12, accepted=4, accepted_length_hist=[100])

    data = rollups.accepted_length_histogram(endpoint_id=endpoint.pk, since=NOW - timedelta(hours=1), until=NOW)

    assert data == {"shadow": [1, 3, 0, 1]}


def test_fleet_summary_splits_last_hour_from_last_day(endpoint):
    other = Endpoint.objects.create(name="idle", base_url="http://127.0.0.1:9/")
    prod(endpoint, NOW - timedelta(minutes=10), drafted=10, accepted=8, tok_s=30.0, baseline_tok_s=10.0, multiplier=3.0)
    prod(endpoint, NOW - timedelta(hours=5), drafted=10, accepted=2, tok_s=12.0, baseline_tok_s=10.0, multiplier=1.2)
    shadow(endpoint, NOW - timedelta(hours=5), drafted=20, accepted=10, alpha=0.5, multiplier=1.5)
    make_record(endpoint, at=NOW - timedelta(minutes=1), mode=Mode.PROD, action=Action.SKIPPED, reason="n > 1")
    prod(endpoint, NOW - timedelta(days=3), drafted=10, accepted=0, multiplier=0.5)

    summary = rollups.fleet_summary(now=NOW)

    assert other.pk not in summary
    hour, day = summary[endpoint.pk]["hour"], summary[endpoint.pk]["day"]
    assert (hour["requests"], hour["speculated"], hour["skipped"], hour["shadowed"]) == (2, 1, 1, 0)
    assert hour["acceptance_rate"] == 0.8
    assert hour["multiplier"] == 3.0
    assert hour["projected_multiplier"] is None
    assert (day["requests"], day["speculated"], day["shadowed"]) == (4, 2, 1)
    assert day["acceptance_rate"] == 0.5  # (8 + 2 + 10) / (10 + 10 + 20)
    assert day["multiplier"] == 2.1
    assert day["projected_multiplier"] == 1.5
    assert (day["tok_s"], day["baseline_tok_s"]) == (21.0, 10.0)


def test_measured_acceptance_reads_only_shadow_measurements(endpoint):
    shadow(endpoint, NOW - timedelta(minutes=5), drafted=10, accepted=6, alpha=0.7, mean_accepted_len=3.0, k=5)
    shadow(endpoint, NOW - timedelta(minutes=6), drafted=30, accepted=10, alpha=0.5, mean_accepted_len=2.0, k=5)
    prod(endpoint, NOW - timedelta(minutes=5), drafted=10, accepted=10, alpha=1.0)

    data = rollups.measured_acceptance(endpoint_id=endpoint.pk, since=NOW - timedelta(hours=1), until=NOW)

    assert data["records"] == 2
    assert data["acceptance_rate"] == 0.4
    assert data["alpha"] == 0.6
    assert data["mean_accepted_len"] == 2.5


def test_unknown_metric_or_range_is_refused_with_the_choices(endpoint):
    with pytest.raises(ValueError, match="acceptance_rate"):
        rollups.timeseries(endpoint_id=endpoint.pk, metric="nope")
    with pytest.raises(ValueError, match="hour, day, week"):
        rollups.timeseries(endpoint_id=endpoint.pk, metric="alpha", range_name="year")
