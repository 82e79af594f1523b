"""Writes behind the request (speculation.services.batched_writer): a full batch written at once, the rest within
the interval, a full queue dropping and counting, a failed batch logged without stopping the next; and the stage
records' and the captures' writers both on it, with their own bounds."""

from __future__ import annotations

import asyncio
import logging

import pytest
from asgiref.sync import async_to_sync

from ace import background
from fleet.models import Endpoint
from speculation.models import CapturedRequest, CaptureSetting, StageRecord
from speculation.selectors import metrics
from speculation.services import captures, records
from speculation.services.batched_writer import BatchedWriter


def _writer(*, max_rows: int = 100, batch_rows: int = 3, flush_interval_s: float = 3600.0, fail=()):
    """A writer whose writes are kept in `batches` (a batch with a row in `fail` raises)."""
    batches: list[list[int]] = []

    def write(rows):
        if any(row["n"] in fail for row in rows):
            raise RuntimeError("disk full")
        batches.append([row["n"] for row in rows])
        return len(rows)

    dropped: list[int] = []
    writer = BatchedWriter(
        what="rows",
        write=write,
        max_rows=lambda: max_rows,
        batch_rows=batch_rows,
        flush_interval_s=flush_interval_s,
        on_drop=lambda row: dropped.append(row["n"]),
    )
    return writer, batches, dropped


async def _stop_flushers() -> None:
    """Cancel flushers still waiting out a long interval (their loop ends with the test)."""
    tasks = list(background._pending)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


def test_it_writes_a_full_batch_at_once_without_waiting_for_the_interval():
    writer, batches, _ = _writer(batch_rows=3, flush_interval_s=3600.0)

    async def run():
        writer.put({"n": 0})
        writer.put({"n": 1})
        await asyncio.sleep(0.05)
        written_before_full = list(batches)
        writer.put({"n": 2})  # the batch is full: the flusher wakes
        await _until(lambda: batches)
        await _stop_flushers()
        return written_before_full

    assert async_to_sync(run)() == []
    assert batches == [[0, 1, 2]] and writer.queued() == 0


def test_it_writes_what_waits_within_the_interval():
    writer, batches, _ = _writer(batch_rows=100, flush_interval_s=0.05)

    async def run():
        writer.put({"n": 7})
        await _until(lambda: batches)

    async_to_sync(run)()
    assert batches == [[7]]


def test_a_full_queue_drops_and_counts_without_blocking():
    writer, batches, dropped = _writer(max_rows=2, batch_rows=100)

    async def run():
        kept = [writer.put({"n": n}) for n in range(5)]
        await _stop_flushers()
        return kept

    assert async_to_sync(run)() == [True, True, False, False, False]
    assert writer.dropped == 3 and dropped == [2, 3, 4]
    assert writer.flush() == 2 and batches == [[0, 1]]


def test_a_failed_batch_is_logged_and_the_next_one_still_written(caplog):
    writer, batches, _ = _writer(batch_rows=2, fail={1})
    writer.queue.extend({"n": n} for n in range(4))

    with caplog.at_level(logging.ERROR, logger="speculation.services.batched_writer"):
        assert writer.flush() == 2

    assert batches == [[2, 3]]
    assert [r.getMessage() for r in caplog.records] == ["2 rows not written"]


@pytest.fixture
def endpoint(db):
    endpoint = Endpoint.objects.create(name="batched", base_url="http://127.0.0.1:9", kind="vllm")
    CaptureSetting.objects.create(endpoint=endpoint, enabled=True, sample_rate=1.0)
    return endpoint


@pytest.fixture(autouse=True)
def empty_queues():
    for writer in (records.writer, captures.writer):
        writer.queue.clear()
    yield
    for writer in (records.writer, captures.writer):
        writer.queue.clear()


def _keep_record(endpoint_id: int, n: int) -> None:
    records.keep_record(endpoint_id=endpoint_id, request_id=f"r{n}", mode="prod", action="skipped", reason="r")


def _keep_capture(endpoint_id: int, n: int) -> None:
    captures.keep_capture(endpoint_id=endpoint_id, workload="w", mode="off", prompt_ids=[n], output_ids=[n + 1])


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("module", "keep", "model"),
    [(records, _keep_record, StageRecord), (captures, _keep_capture, CapturedRequest)],
    ids=["stage records", "captures"],
)
def test_both_writers_share_the_mechanism_with_their_own_bounds(endpoint, settings, monkeypatch, module, keep, model):
    # given: each writer's queue bounded at 2 rows, and its interval long enough that nothing is written meanwhile
    settings.RECORD_QUEUE_ROWS = 2
    monkeypatch.setattr(captures, "QUEUE_ROWS", 2)
    monkeypatch.setattr(module.writer, "flush_interval_s", 3600.0)
    dropped_before = module.writer.dropped
    metric_before = metrics.REGISTRY.get_sample_value("ace_stage_records_dropped_total") or 0.0

    async def run():
        for n in range(3):
            keep(endpoint.pk, n)  # returns at once, also when full
        queued = module.queued()
        written = await module.aflush()  # what the lifespan's shutdown does
        await _stop_flushers()
        return queued, written

    # then: two queued and written by one flush, the third dropped and counted
    assert isinstance(module.writer, BatchedWriter)
    assert module.writer.batch_rows == module.BATCH_ROWS
    assert async_to_sync(run)() == (2, 2)
    assert model.objects.count() == 2
    assert module.writer.dropped - dropped_before == 1
    metric_after = metrics.REGISTRY.get_sample_value("ace_stage_records_dropped_total") or 0.0
    assert metric_after - metric_before == (1 if module is records else 0)  # captures count in no metric
