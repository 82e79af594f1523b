"""The gateway's stage records: queued behind the request and written in batches, none lost to a busy database or a
bad neighbour in the same batch, flushed on shutdown, dropped (and counted) only when the queue is full
(speculation.services.records)."""

from __future__ import annotations

import logging

import pytest
from asgiref.sync import async_to_sync
from django.db import OperationalError

from fleet.models import Endpoint
from speculation.gateway import background
from speculation.gateway.asgi import GatewayApp
from speculation.models import StageRecord
from speculation.selectors import metrics
from speculation.services import records


@pytest.fixture
def endpoint(db):
    return Endpoint.objects.create(name="recorded", base_url="http://127.0.0.1:9", kind="vllm")


@pytest.fixture
def inserts(monkeypatch):
    """The size of each database call the writer makes."""
    sizes: list[int] = []
    insert = records._insert

    def counted(rows):
        sizes.append(len(rows))
        return insert(rows)

    monkeypatch.setattr(records, "_insert", counted)
    return sizes


@pytest.fixture(autouse=True)
def empty_queue():
    records.writer.queue.clear()
    yield
    records.writer.queue.clear()


def _record(endpoint_id: int, request_id: str, **fields) -> dict:
    return dict(endpoint_id=endpoint_id, request_id=request_id, mode="prod", action="skipped", reason="r", **fields)


def _dropped() -> float:
    return metrics.REGISTRY.get_sample_value("ace_stage_records_dropped_total") or 0.0


async def _settle() -> None:
    import asyncio

    while background._pending:
        await asyncio.gather(*list(background._pending), return_exceptions=True)


@pytest.mark.django_db(transaction=True)
def test_records_kept_by_many_requests_are_written_in_one_insert_behind_them(endpoint, inserts):
    async def run():
        # when: 600 requests end, none of them waiting for its record
        for i in range(600):
            records.keep_record(**_record(endpoint.pk, f"r{i}", output_tokens=i))
        queued_after_requests = records.queued()
        await _settle()
        return queued_after_requests

    queued = async_to_sync(run)()

    # then: nothing was written while the requests ran; then one insert per full batch, the rest in one more
    assert queued == 600
    assert inserts == [records.BATCH_ROWS, 600 - records.BATCH_ROWS]
    kept = dict(StageRecord.objects.values_list("request_id", "output_tokens"))
    assert kept == {f"r{i}": i for i in range(600)}


@pytest.mark.django_db(transaction=True)
def test_a_full_queue_drops_records_and_counts_them_without_blocking(endpoint, settings, inserts):
    settings.RECORD_QUEUE_ROWS = 5
    before = _dropped()

    async def run():
        for i in range(8):
            records.keep_record(**_record(endpoint.pk, f"r{i}"))  # returns at once even when full
        await _settle()

    async_to_sync(run)()

    assert StageRecord.objects.count() == 5
    assert _dropped() - before == 3
    assert any(m.name == "ace_stage_records_dropped" for m in metrics.REGISTRY.collect())


@pytest.mark.django_db(transaction=True)
def test_the_lifespan_shutdown_writes_what_is_queued(endpoint, monkeypatch):
    monkeypatch.setattr(records.writer, "flush_interval_s", 3600.0)  # the flusher would not write before shutdown
    app = GatewayApp(fallback=None)
    sent: list[dict] = []

    async def run():
        for i in range(3):
            records.keep_record(**_record(endpoint.pk, f"r{i}"))
        messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

        async def receive():
            return next(messages)

        async def send(message):
            sent.append(message)

        await app({"type": "lifespan"}, receive, send)
        queued_at_end = records.queued()
        for task in list(background._pending):
            task.cancel()
        return queued_at_end

    assert async_to_sync(run)() == 0
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert sorted(StageRecord.objects.values_list("request_id", flat=True)) == ["r0", "r1", "r2"]


@pytest.mark.django_db(transaction=True)
def test_a_busy_database_is_retried_and_a_bad_row_costs_only_its_own_record(endpoint, monkeypatch, caplog):
    busy = {"left": 1}
    insert = records._insert

    def once_busy(rows):
        if busy["left"]:
            busy["left"] -= 1
            raise OperationalError("database is locked")
        return insert(rows)

    monkeypatch.setattr(records, "_insert", once_busy)
    failures = metrics.REGISTRY.get_sample_value("ace_stage_record_write_failures_total") or 0.0

    async def run():
        # when: one batch of three, one of them naming no endpoint, meets a busy database
        for request_id, endpoint_id in (("good-1", endpoint.pk), ("bad", endpoint.pk + 999), ("good-2", endpoint.pk)):
            records.keep_record(**_record(endpoint_id, request_id))
        await _settle()

    with caplog.at_level(logging.ERROR, logger="speculation.services.records"):
        async_to_sync(run)()

    # then: the busy database was waited out, the good rows written, the bad one logged with its request id
    assert set(StageRecord.objects.values_list("request_id", flat=True)) == {"good-1", "good-2"}
    assert [r.getMessage() for r in caplog.records] == [
        "stage record for request bad (prod/skipped) could not be written"
    ]
    assert metrics.REGISTRY.get_sample_value("ace_stage_record_write_failures_total") - failures == 1


@pytest.mark.django_db(transaction=True)
def test_flush_writes_what_is_queued_from_sync_code(endpoint):
    records.writer.queue.extend(_record(endpoint.pk, f"r{i}") for i in range(3))
    assert records.flush() == 3
    assert records.queued() == 0
    assert StageRecord.objects.count() == 3
