"""Retention: raw stage records past ACE_RECORD_RETENTION are pruned in small batches once rolled up, old per-minute
rollups become hourly ones, and no chart sum moves (speculation.services.records_retention)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from fleet.models import Endpoint
from speculation.models import StageRecord, StageRollup
from speculation.selectors import rollup_store, rollups
from speculation.services import records
from speculation.services.records_retention import prune


@pytest.fixture
def endpoint(db):
    return Endpoint.objects.create(name="kept", base_url="http://127.0.0.1:9", kind="vllm")


def _rows(endpoint_id: int, n: int, *, age: timedelta, spread: timedelta, prefix: str) -> list[dict]:
    now = timezone.now()
    return [
        dict(
            endpoint_id=endpoint_id,
            request_id=f"{prefix}{i}",
            created_at=now - age - spread * i / max(1, n),
            mode="shadow",
            action="would_speculate",
            k=4,
            drafted_tokens=8,
            accepted_tokens=i % 9,
            target_passes=2,
            alpha=0.5,
            multiplier=1.0 + (i % 7) / 10,
            per_position_acceptance=[1.0, 0.5, (i % 3) / 3],
            accepted_length_hist=[0, 1, i % 2],
        )
        for i in range(n)
    ]


def _charts(endpoint: Endpoint) -> dict:
    charts = rollups.endpoint_charts(
        endpoint_id=endpoint.pk, metrics=("acceptance_rate", "multiplier"), range_name="day"
    )
    for metric in ("acceptance_rate", "multiplier"):
        charts[metric].pop("until"), charts[metric].pop("since")
    return charts


def _rollup_rows() -> list[tuple]:
    return list(
        StageRollup.objects.order_by("bucket_start", "id").values_list("bucket_start", "n", "accepted", "mult_sum")
    )


@pytest.mark.django_db(transaction=True)
def test_it_prunes_records_past_retention_in_batches_and_no_chart_sum_moves(endpoint, settings):
    # given: 200 records 2-3 hours old (past a one-hour retention) and 20 from the last half hour
    settings.RECORD_RETENTION = timedelta(hours=1)
    records._insert(_rows(endpoint.pk, 200, age=timedelta(hours=2), spread=timedelta(hours=1), prefix="old"))
    records._insert(_rows(endpoint.pk, 20, age=timedelta(minutes=5), spread=timedelta(minutes=25), prefix="new"))
    rollup_store.refresh_rollups()
    charts_before, rollups_before = _charts(endpoint), _rollup_rows()
    summary_before = rollups.fleet_summary(endpoint_ids=[endpoint.pk])

    # when
    done = prune(batch=30)

    # then: the old raw rows are gone, 30 per statement; the new ones stay; rollups and charts are unchanged
    assert done.records == 200 and len(done.batch_seconds) == 7  # 6 full batches and the last 20
    assert set(StageRecord.objects.values_list("request_id", flat=True)) == {f"new{i}" for i in range(20)}
    assert _rollup_rows() == rollups_before
    assert _charts(endpoint) == charts_before
    assert rollups.fleet_summary(endpoint_ids=[endpoint.pk]) == summary_before
    assert charts_before["multiplier"]["series"][0]["n"]  # the charts did show the pruned records


@pytest.mark.django_db(transaction=True)
def test_it_never_prunes_a_minute_that_is_not_rolled_up(endpoint, settings):
    settings.RECORD_RETENTION = timedelta(hours=1)
    records._insert(_rows(endpoint.pk, 10, age=timedelta(hours=2), spread=timedelta(minutes=10), prefix="old"))
    now = timezone.now()
    rollup_store.refresh_rollups(now=now - timedelta(hours=3))  # the rollup stops before these records

    # when: the rollup cannot move on (refreshing is stubbed out), so its watermark stays behind the records
    from speculation.services import records_retention

    real = records_retention.rollup_store.refresh_rollups
    records_retention.rollup_store.refresh_rollups = lambda **_: 0
    try:
        done = prune(now=now)
    finally:
        records_retention.rollup_store.refresh_rollups = real

    assert done.records == 0 and StageRecord.objects.count() == 10


@pytest.mark.django_db(transaction=True)
def test_old_minutes_become_hours_with_the_same_sums(endpoint, settings):
    settings.RECORD_RETENTION = timedelta(days=1)
    settings.ROLLUP_RETENTION = timedelta(days=7)
    records._insert(_rows(endpoint.pk, 120, age=timedelta(days=9), spread=timedelta(hours=3), prefix="old"))
    records._insert(_rows(endpoint.pk, 10, age=timedelta(minutes=10), spread=timedelta(minutes=5), prefix="new"))
    rollup_store.refresh_rollups()
    now = timezone.now()
    window = dict(since=now - timedelta(days=10), until=now, bucket_s=3600)
    before = rollup_store.sums(**window)
    minutes = StageRollup.objects.filter(bucket_start__lt=now - timedelta(days=7)).count()

    done = prune(now=now)

    old = StageRollup.objects.filter(bucket_start__lt=now - timedelta(days=7))
    assert done.records == 120 and done.hourly_rollups == old.count() <= 4 < minutes
    assert set(old.values_list("seconds", flat=True)) == {3600}
    assert StageRollup.objects.filter(bucket_start__gte=now - timedelta(days=7), seconds=60).exists()
    after = rollup_store.sums(**window)
    assert after.keys() == before.keys()
    for key, row in before.items():
        assert after[key] == pytest.approx(row), key


@pytest.mark.django_db(transaction=True)
def test_a_writer_waits_for_one_batch_at_most_while_pruning(endpoint, settings):
    # given: 30,000 records past retention, rolled up
    settings.RECORD_RETENTION = timedelta(hours=1)
    records._insert(_rows(endpoint.pk, 30_000, age=timedelta(hours=2), spread=timedelta(hours=2), prefix="old"))
    rollup_store.refresh_rollups()
    waits: list[float] = []
    pruning = threading.Event()
    stop = threading.Event()

    def writer() -> None:
        try:
            i = 0
            while not stop.is_set():
                started = time.perf_counter()
                records._insert([_rows(endpoint.pk, 1, age=timedelta(0), spread=timedelta(0), prefix=f"w{i}-")[0]])
                if pruning.is_set():
                    waits.append(time.perf_counter() - started)
                i += 1
                time.sleep(0.002)
        finally:
            connection.close()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        # when: pruning in batches of 1,000 while the writer writes
        pruning.set()
        started = time.perf_counter()
        done = prune(batch=1000)
        total = time.perf_counter() - started
    finally:
        stop.set()
        thread.join()

    # then: the writer kept writing between batches; its longest wait is about one batch, far below the whole prune
    assert done.records == 30_000 and len(done.batch_seconds) == 31
    slowest_batch = max(done.batch_seconds)
    assert len(waits) >= 5
    # one batch, the busy handler's polling and this thread's turn at the GIL, on a loaded machine
    assert max(waits) < 2 * slowest_batch + 0.15
    assert max(waits) < total / 3  # a prune in one transaction would hold the writer for all of it
