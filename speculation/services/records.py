"""Stage records: one row per request the speculative_decoding stage saw (never for off mode)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from django.db import OperationalError

from fleet.models import Endpoint
from speculation.models import StageRecord
from speculation.selectors import metrics

logger = logging.getLogger(__name__)

_FIELDS = {f.name for f in StageRecord._meta.get_fields() if f.concrete and f.name not in ("id", "created_at")}


def _clean(fields: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if name in _FIELDS and value is not None}


# Endpoint names for the metrics' `endpoint` label, per process; a renamed endpoint shows its new name within
# NAME_TTL_S.
NAME_TTL_S = 300.0
_names: dict[int, tuple[str, float]] = {}


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
    written = await _awrite(endpoint_id=endpoint_id, request_id=request_id, mode=mode, action=action, fields=fields)
    if not written:
        metrics.RECORD_WRITE_FAILURES.inc()
    metrics.observe_record(endpoint=await _aendpoint_label(endpoint_id), mode=mode, action=action, fields=fields)


async def _awrite(*, endpoint_id: int, request_id: str, mode: str, action: str, fields: dict[str, Any]) -> bool:
    for attempt in range(WRITE_ATTEMPTS):
        try:
            await StageRecord.objects.acreate(
                endpoint_id=endpoint_id, request_id=request_id, mode=mode, action=action, **_clean(fields)
            )
            return True
        except OperationalError:
            if attempt == WRITE_ATTEMPTS - 1:
                logger.exception("stage record for request %s (%s/%s) not written", request_id, mode, action)
                return False
            await asyncio.sleep(0.05 * 2**attempt)
        except Exception:  # noqa: BLE001 - a record must never break a response; it is logged with the request id
            logger.exception("stage record for request %s (%s/%s) could not be written", request_id, mode, action)
            return False
    return False


def keep_record(**fields: Any) -> None:
    """Write a record from the gateway without tying it to the request's task: a client that disconnects
    right after the last byte cancels its request task, and the record must still be written."""
    from speculation.gateway.background import spawn

    spawn(arecord_stage(**fields), what=f"stage record {fields.get('request_id')}")
