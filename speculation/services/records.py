"""Stage records: one row per request the speculative_decoding stage saw (never for off mode)."""

from __future__ import annotations

import logging
from typing import Any

from speculation.models import StageRecord

logger = logging.getLogger(__name__)

_FIELDS = {f.name for f in StageRecord._meta.get_fields() if f.concrete and f.name not in ("id", "created_at")}


def _clean(fields: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if name in _FIELDS and value is not None}


def record_stage(*, endpoint_id: int, request_id: str, mode: str, action: str, **metrics: Any) -> StageRecord:
    return StageRecord.objects.create(
        endpoint_id=endpoint_id, request_id=request_id, mode=mode, action=action, **_clean(metrics)
    )


async def arecord_stage(*, endpoint_id: int, request_id: str, mode: str, action: str, **metrics: Any) -> None:
    """The gateway's write; a failure is logged loudly (the response is already on its way)."""
    try:
        await StageRecord.objects.acreate(
            endpoint_id=endpoint_id, request_id=request_id, mode=mode, action=action, **_clean(metrics)
        )
    except Exception:  # noqa: BLE001 - a record must never break a response; it is logged with the request id
        logger.exception("stage record for request %s (%s/%s) could not be written", request_id, mode, action)
