"""The gateway's stage records: written together when requests end together, none lost to a busy database or a bad
neighbour in the same group (speculation.services.records)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from asgiref.sync import async_to_sync
from django.db import OperationalError

from fleet.models import Endpoint
from speculation.models import StageRecord
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


def _record(endpoint_id: int, request_id: str, **fields) -> dict:
    return dict(endpoint_id=endpoint_id, request_id=request_id, mode="prod", action="skipped", reason="r", **fields)


@pytest.mark.django_db(transaction=True)
def test_records_of_requests_that_end_together_are_written_in_one_call_after_the_first(endpoint, inserts):
    async def run():
        # when: ten requests end at once (their records spawned in the same moment)
        await asyncio.gather(
            *(records.arecord_stage(**_record(endpoint.pk, f"r{i}", output_tokens=i)) for i in range(10))
        )
        # and: one ends alone afterwards
        await records.arecord_stage(**_record(endpoint.pk, "alone"))

    async_to_sync(run)()

    # then: every record is there with its fields
    kept = dict(StageRecord.objects.values_list("request_id", "output_tokens"))
    assert kept == {**{f"r{i}": i for i in range(10)}, "alone": 0}
    # the first is written at once, the nine that ended while it was written in one call, the last alone
    assert inserts == [1, 9, 1]


@pytest.mark.django_db(transaction=True)
def test_a_busy_database_is_retried_and_a_bad_row_costs_only_its_own_record(endpoint, inserts, monkeypatch, caplog):
    busy = {"left": 1}
    insert = records._insert

    def once_busy(rows):
        if busy["left"]:
            busy["left"] -= 1
            raise OperationalError("database is locked")
        return insert(rows)

    monkeypatch.setattr(records, "_insert", once_busy)

    async def run():
        # when: a group of three ends together after one alone, one of the three naming no endpoint
        first = records.arecord_stage(**_record(endpoint.pk, "first"))
        group = [
            records.arecord_stage(**_record(endpoint.pk, "good-1")),
            records.arecord_stage(**_record(endpoint.pk + 999, "bad")),
            records.arecord_stage(**_record(endpoint.pk, "good-2")),
        ]
        await asyncio.gather(first, *group)

    with caplog.at_level(logging.ERROR, logger="speculation.services.records"):
        async_to_sync(run)()

    # then: the busy database was waited out, the good rows written, the bad one logged with its request id
    assert set(StageRecord.objects.values_list("request_id", flat=True)) == {"first", "good-1", "good-2"}
    assert [r.getMessage() for r in caplog.records] == [
        "stage record for request bad (prod/skipped) could not be written"
    ]
