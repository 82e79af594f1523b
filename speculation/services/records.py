"""Stage records: one row per request the speculative_decoding stage saw (never for off mode)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from django.db import OperationalError

from speculation.models import StageRecord

logger = logging.getLogger(__name__)

_FIELDS = {f.name for f in StageRecord._meta.get_fields() if f.concrete and f.name not in ("id", "created_at")}


def _clean(fields: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if name in _FIELDS and value is not None}


def record_stage(*, endpoint_id: int, request_id: str, mode: str, action: str, **metrics: Any) -> StageRecord:
    return StageRecord.objects.create(
        endpoint_id=endpoint_id, request_id=request_id, mode=mode, action=action, **_clean(metrics)
    )


WRITE_ATTEMPTS = 4


async def arecord_stage(*, endpoint_id: int, request_id: str, mode: str, action: str, **metrics: Any) -> None:
    """The gateway's write, retried while the database is busy; a final failure is logged with the request id."""
    for attempt in range(WRITE_ATTEMPTS):
        try:
            await StageRecord.objects.acreate(
                endpoint_id=endpoint_id, request_id=request_id, mode=mode, action=action, **_clean(metrics)
            )
            return
        except OperationalError:
            if attempt == WRITE_ATTEMPTS - 1:
                logger.exception("stage record for request %s (%s/%s) not written", request_id, mode, action)
                return
            await asyncio.sleep(0.05 * 2**attempt)
        except Exception:  # noqa: BLE001 - a record must never break a response; it is logged with the request id
            logger.exception("stage record for request %s (%s/%s) could not be written", request_id, mode, action)
            return


def keep_record(**fields: Any) -> None:
    """Write a record from the gateway without tying it to the request's task: a client that disconnects
    right after the last byte cancels its request task, and the record must still be written."""
    from speculation.gateway.background import spawn

    spawn(arecord_stage(**fields), what=f"stage record {fields.get('request_id')}")
