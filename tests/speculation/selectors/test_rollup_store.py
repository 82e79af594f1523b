"""Per-minute rollups plus the raw edges give exactly what aggregating the raw records gives."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db.models import Sum
from django.utils import timezone

from fleet.models import Endpoint
from speculation.models import Action, Mode, RollupState, StageRecord, StageRollup
from speculation.selectors import rollup_store

pytestmark = pytest.mark.django_db


@pytest.fixture
def endpoint() -> Endpoint:
    return Endpoint.objects.create(name="llama", base_url="http://127.0.0.1:9/")


def records_at(endpoint: Endpoint, ages: list[timedelta]) -> None:
    now = timezone.now()
    for i, age in enumerate(ages):
        record = StageRecord.objects.create(
            endpoint=endpoint,
            request_id=f"r{i}",
            mode=Mode.SHADOW,
            action=Action.WOULD_SPECULATE,
            drafted_tokens=10 + i,
            accepted_tokens=i,
            target_passes=3,
            k=5,
            alpha=0.1 * (i % 10),
            multiplier=1.0 + i / 100,
            per_position_acceptance=[(i % 3) / 3, 1.0],
            accepted_length_hist=[1, i % 4],
        )
        StageRecord.objects.filter(pk=record.pk).update(created_at=now - age)


def test_rolled_up_sums_equal_raw_sums_over_any_window(endpoint):
    # given records from 3 hours ago to 10 seconds ago, some inside the grace period
    ages = [timedelta(seconds=s) for s in (10, 50, 200, 260, 600, 601, 3599, 3601, 7200, 10_000)]
    records_at(endpoint, ages)
    now = timezone.now()
    windows = [(now - timedelta(hours=1), now), (now - timedelta(minutes=7, seconds=13), now - timedelta(minutes=1))]
    raw = [rollup_store.sums(since=s, until=u, bucket_s=600, refresh=False) for s, u in windows]
    assert not StageRollup.objects.exists()  # refresh=False and no state: raw records only

    # when
    written = rollup_store.refresh_rollups()
    combined = [rollup_store.sums(since=s, until=u, bucket_s=600, refresh=False) for s, u in windows]

    # then: the rollup holds the closed minutes, the newest records stay raw, the totals do not move
    assert written > 0
    assert StageRollup.objects.aggregate(n=Sum("n"))["n"] == 8  # all but the two newest
    for got, want in zip(combined, raw, strict=True):
        assert got.keys() == want.keys()
        for key in want:  # float sums may differ in the last bits with the summation order
            assert got[key] == pytest.approx(want[key], rel=1e-9), key
    assert sum(row["n"] for row in combined[0].values()) == 7  # 10 s .. 3599 s old


def test_refresh_is_idempotent_and_moves_the_watermark(endpoint):
    records_at(endpoint, [timedelta(minutes=m) for m in (5, 6, 30)])

    first = rollup_store.refresh_rollups()
    second = rollup_store.refresh_rollups()

    assert (first, second) == (3, 0)
    state = RollupState.objects.get(name=rollup_store.STATE_NAME)
    assert timezone.now() - state.rolled_until < rollup_store.GRACE + timedelta(minutes=1)


def test_json_lists_are_summed_into_columns(endpoint):
    now = timezone.now()
    minute = now.replace(second=0, microsecond=0) - timedelta(minutes=10)
    records_at(endpoint, [now - (minute + timedelta(seconds=s)) for s in (10, 20, 30)])  # one minute

    rollup_store.refresh_rollups()

    (row,) = StageRollup.objects.all()
    assert (row.n, row.h0, row.h1, row.h2) == (3, 3, 0 + 1 + 2, 0)
    # rates (0, 1/3, 2/3) and (1, 1, 1) times 3 passes each
    assert (row.p1, row.p2, row.p3) == (pytest.approx(3.0), pytest.approx(9.0), 0.0)
    assert (row.drafted, row.accepted, row.passes) == (33, 3, 9)


def test_bucket_width_must_be_whole_minutes():
    now = timezone.now()
    with pytest.raises(ValueError, match="multiple of 60"):
        rollup_store.sums(since=now - timedelta(hours=1), until=now, bucket_s=90)


def test_rebuild_counts_records_imported_behind_the_watermark(endpoint):
    records_at(endpoint, [timedelta(minutes=10)])
    rollup_store.refresh_rollups()
    records_at(endpoint, [timedelta(minutes=20)])  # imported late: older than the watermark
    assert StageRollup.objects.aggregate(n=Sum("n"))["n"] == 1

    call_command("refresh_rollups", "--rebuild", stdout=io.StringIO())

    assert StageRollup.objects.aggregate(n=Sum("n"))["n"] == 2


def test_positions_past_eight_are_kept_for_k_up_to_sixteen(endpoint):
    # given a K=16 record, old enough to be rolled up, accepting at every position and 16 tokens in its one step
    record = StageRecord.objects.create(
        endpoint=endpoint,
        request_id="k16",
        mode=Mode.SHADOW,
        action=Action.WOULD_SPECULATE,
        drafted_tokens=16,
        accepted_tokens=16,
        target_passes=1,
        k=16,
        per_position_acceptance=[1.0] * 16,
        accepted_length_hist=[0] * 16 + [1],
    )
    StageRecord.objects.filter(pk=record.pk).update(created_at=timezone.now() - timedelta(minutes=10))
    # when
    rollup_store.refresh_rollups()
    # then positions 9..16 and the 16-accepted bucket are in the rollup (they were dropped with 8 columns)
    (row,) = StageRollup.objects.all()
    assert [getattr(row, f"p{i}") for i in range(9, 17)] == [1.0] * 8
    assert row.h16 == 1


def test_the_beat_task_rolls_up_closed_minutes(endpoint):
    # given records older than the grace period and no page view since
    from speculation.worker.tasks import refresh_rollups_task

    records_at(endpoint, [timedelta(minutes=10)] * 2)
    # when beat's task runs (called in-process: the task is a thin wrapper)
    rows = refresh_rollups_task()
    # then the minute is summed without any page having been viewed
    assert rows == 1
    assert StageRollup.objects.get().n == 2


def test_a_workload_filter_reads_only_that_workloads_records_rolled_up_or_raw(endpoint):
    # given: records of two workloads, old ones rolled up and new ones still raw
    records_at(endpoint, [timedelta(minutes=m) for m in (0, 0.5, 5, 6, 30, 31)])
    StageRecord.objects.filter(request_id__in=["r0", "r2", "r4"]).update(workload="code")
    StageRecord.objects.filter(request_id__in=["r1", "r3", "r5"]).update(workload="chat")
    rollup_store.refresh_rollups()
    assert StageRollup.objects.filter(workload="code").exists() and StageRollup.objects.filter(workload="chat").exists()
    now = timezone.now()

    # when
    code = rollup_store.sums(since=now - timedelta(hours=1), until=now, workloads=["code"], refresh=False)
    every = rollup_store.sums(since=now - timedelta(hours=1), until=now, group=["workload"], refresh=False)

    # then: code is r0, r2, r4 (drafted 10 + i), whether read from the rollup or raw
    assert code[()]["n"] == 3 and code[()]["drafted"] == 10 + 12 + 14
    assert {key: row["n"] for key, row in every.items()} == {("code",): 3, ("chat",): 3}
