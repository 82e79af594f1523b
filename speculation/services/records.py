"""Stage records: one row per request the speculative_decoding stage saw (never for off mode)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from asgiref.sync import sync_to_async
from django.db import OperationalError, transaction

from fleet.models import Endpoint
from speculation.models import StageRecord
from speculation.selectors import metrics

logger = logging.getLogger(__name__)

_FIELDS = {f.name for f in StageRecord._meta.get_fields() if f.concrete and f.name not in ("id", "created_at")}


def _clean(fields: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if name in _FIELDS and value is not None}


# Endpoint names for the metrics' `endpoint` label, per process; a renamed endpoint shows its new name within
# NAME_TTL_S (at once in the process that saved it: speculation.signals).
NAME_TTL_S = 300.0
_names: dict[int, tuple[str, float]] = {}


def forget_name(endpoint_id: int | None) -> None:
    _names.pop(endpoint_id, None)


def _cached_name(endpoint_id: int) -> str | None:
    hit = _names.get(endpoint_id)
    return hit[0] if hit is not None and time.monotonic() - hit[1] < NAME_TTL_S else None


def _endpoint_label(endpoint_id: int) -> str:
    name = _cached_name(endpoint_id)
    if name is None:
        try:
            name = Endpoint.objects.filter(pk=endpoint_id).values_list("name", flat=True).first()
        except Exception:  # noqa: BLE001 - a label must never break a record; the id stands in
            name = None
        name = name or str(endpoint_id)
        _names[endpoint_id] = (name, time.monotonic())
    return name


async def _aendpoint_label(endpoint_id: int) -> str:
    name = _cached_name(endpoint_id)
    if name is None:
        try:
            name = await Endpoint.objects.filter(pk=endpoint_id).values_list("name", flat=True).afirst()
        except Exception:  # noqa: BLE001 - as above
            name = None
        name = name or str(endpoint_id)
        _names[endpoint_id] = (name, time.monotonic())
    return name


def record_stage(*, endpoint_id: int, request_id: str, mode: str, action: str, **fields: Any) -> StageRecord:
    record = StageRecord.objects.create(
        endpoint_id=endpoint_id, request_id=request_id, mode=mode, action=action, **_clean(fields)
    )
    metrics.observe_record(endpoint=_endpoint_label(endpoint_id), mode=mode, action=action, fields=fields)
    return record


WRITE_ATTEMPTS = 4


async def arecord_stage(*, endpoint_id: int, request_id: str, mode: str, action: str, **fields: Any) -> None:
    """The gateway's write, retried while the database is busy; a final failure is logged with the request id.

    The request counts in the metrics either way (a failed write counts in ace_stage_record_write_failures)."""
    row = dict(endpoint_id=endpoint_id, request_id=request_id, mode=mode, action=action, **_clean(fields))
    written = await _group_write(row)
    if not written:
        metrics.RECORD_WRITE_FAILURES.inc()
    metrics.observe_record(endpoint=await _aendpoint_label(endpoint_id), mode=mode, action=action, fields=fields)


# Group commit: the records of the requests that end while a write is under way are written together when it is done,
# in one transaction of one database call; a request that ends alone is written at once, as before. Under load that is
# one hop to Django's database thread and one commit for several requests (alone, a plain prod request's record cost
# the web process 0.7 ms of CPU: docs/BENCHMARKS.md, the eleventh session). Per event loop: its futures are its own.
_queued: dict[int, list[tuple[dict[str, Any], asyncio.Future]]] = {}
_writing: dict[int, asyncio.AbstractEventLoop] = {}  # the loop itself is held, so its id is not reused meanwhile


async def _group_write(row: dict[str, Any]) -> bool:
    loop = asyncio.get_running_loop()
    key = id(loop)
    done: asyncio.Future = loop.create_future()
    _queued.setdefault(key, []).append((row, done))
    if key in _writing:  # the write under way takes this one with its next group
        return await done
    _writing[key] = loop
    group: list[tuple[dict[str, Any], asyncio.Future]] = []
    try:
        while _queued.get(key):
            group = _queued.pop(key)
            results = await _awrite([r for r, _ in group])
            for (_, future), result in zip(group, results, strict=True):
                future.set_result(result)
            group = []
    finally:
        _writing.pop(key, None)
        # only when this task was cancelled (its loop is stopping): the records it held are not written
        for _, future in [*group, *_queued.pop(key, [])]:
            if not future.done():
                future.set_result(False)
    return await done


async def _awrite(rows: list[dict[str, Any]]) -> list[bool]:
    """Write the rows in one transaction, retried while the database is busy; which were written. A group that fails
    otherwise is written row by row, so that one bad row costs only its own record."""
    for attempt in range(WRITE_ATTEMPTS):
        try:
            await sync_to_async(_insert, thread_sensitive=True)(rows)
            return [True] * len(rows)
        except OperationalError:
            if attempt == WRITE_ATTEMPTS - 1:
                for row in rows:
                    logger.exception("stage record for request %s (%s/%s) not written", *_what(row))
                return [False] * len(rows)
            await asyncio.sleep(0.05 * 2**attempt)
        except Exception:  # noqa: BLE001 - a record must never break a response; it is logged with the request id
            if len(rows) > 1:
                return [(await _awrite([row]))[0] for row in rows]
            logger.exception("stage record for request %s (%s/%s) could not be written", *_what(rows[0]))
            return [False]
    return [False] * len(rows)


def _what(row: dict[str, Any]) -> tuple[str, str, str]:
    return row["request_id"], row["mode"], row["action"]


def _insert(rows: list[dict[str, Any]]) -> None:
    if len(rows) == 1:
        StageRecord.objects.create(**rows[0])
        return
    with transaction.atomic():
        StageRecord.objects.bulk_create([StageRecord(**row) for row in rows])


def keep_record(**fields: Any) -> None:
    """Write a record from the gateway without tying it to the request's task: a client that disconnects
    right after the last byte cancels its request task, and the record must still be written."""
    from speculation.gateway.background import spawn

    spawn(arecord_stage(**fields), what=f"stage record {fields.get('request_id')}")
