"""Traffic capture: an endpoint's opt-in setting, and the captured requests kept for training (encrypted at rest).

The gateway hands a served request's token ids to `keep_capture` (speculation.gateway.capture): it is queued in a
bounded per-process queue and written behind the request, in batches (speculation.services.batched_writer, as stage
records are); a full queue drops it (counted in `writer.dropped`, logged).
Each row's ids are packed (`pack`) and sealed with the key that encrypts endpoint API keys (fleet.crypto.seal);
only counts and sizes are stored in the clear. A batch is written only for endpoints whose setting is still on,
and an endpoint over its size cap after a batch loses its oldest captures at once; `prune_captures` (beat's
prune_records_task) deletes what is past each endpoint's retention and trims every endpoint to its cap.
"""

from __future__ import annotations

import logging
import struct
from array import array
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from fleet import crypto
from fleet.models import Endpoint
from speculation.models import CapturedRequest, CaptureSetting
from speculation.services.batched_writer import BatchedWriter

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

logger = logging.getLogger(__name__)

QUEUE_ROWS = 2000  # captures waiting to be written per process; beyond it a capture is dropped (logged)
BATCH_ROWS = 200  # cost: sealing a 2,000-token capture takes about 50 us; a batch is one INSERT
FLUSH_INTERVAL_S = 1.0
MAX_RETENTION_DAYS = 3650
MAX_CAP_BYTES = 1 << 40
SETTING_FIELDS = ("enabled", "sample_rate", "retention_days", "max_bytes")

_HEADER = struct.Struct("<II")  # prompt length, output length; then the ids as little-endian uint32


def pack(prompt_ids: list[int], output_ids: list[int]) -> bytes:
    ids = array("I", [*prompt_ids, *output_ids])
    if ids.itemsize != 4:  # pragma: no cover - every platform ACE runs on has a 4-byte unsigned int
        raise RuntimeError("array('I') is not 4 bytes here")
    return _HEADER.pack(len(prompt_ids), len(output_ids)) + ids.tobytes()


def unpack(data: bytes) -> tuple[list[int], list[int]]:
    n_prompt, n_output = _HEADER.unpack_from(data)
    ids = array("I")
    ids.frombytes(data[_HEADER.size :])
    if len(ids) != n_prompt + n_output:
        raise ValueError("packed capture has the wrong length")
    values = ids.tolist()
    return values[:n_prompt], values[n_prompt:]


def open_capture(row: CapturedRequest) -> tuple[list[int], list[int]]:
    """Decrypt one capture: (prompt ids, output ids). For the training run that reads them, never for a page."""
    return unpack(crypto.unseal(row.sealed))


# --- the setting ---------------------------------------------------------------------------------------------


def get_setting(*, endpoint: Endpoint) -> CaptureSetting:
    """The endpoint's setting; an endpoint that never opted in reads as the default (off), unsaved."""
    return CaptureSetting.objects.filter(endpoint=endpoint).first() or CaptureSetting(endpoint=endpoint)


def _checked(fields: dict[str, Any]) -> dict[str, Any]:
    errors: dict[str, list[str]] = {}
    unknown = sorted(set(fields) - set(SETTING_FIELDS))
    for name in unknown:
        errors[name] = [f"not a capture setting (one of {', '.join(SETTING_FIELDS)})"]
    if "enabled" in fields and not isinstance(fields["enabled"], bool):
        errors["enabled"] = ["must be true or false"]
    if "sample_rate" in fields:
        rate = fields["sample_rate"]
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
            errors["sample_rate"] = ["must be a number from 0 to 1"]
    bounds = {"retention_days": (1, MAX_RETENTION_DAYS), "max_bytes": (1, MAX_CAP_BYTES)}
    for name, (low, high) in bounds.items():
        value = fields.get(name)
        if name in fields and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            errors[name] = [f"must be an integer from {low} to {high}"]
    if errors:
        raise ValidationError(errors)
    return fields


def update_setting(*, endpoint: Endpoint, user: AbstractBaseUser | None = None, **fields: Any) -> CaptureSetting:
    """Change the endpoint's capture setting (only the given fields; ValidationError naming a bad one, nothing
    saved); a shorter retention or a lower cap applies to what is stored at once."""
    _checked(fields)
    with transaction.atomic():
        setting, _ = CaptureSetting.objects.select_for_update().get_or_create(endpoint=endpoint)
        for name, value in fields.items():
            setattr(setting, name, float(value) if name == "sample_rate" else value)
        setting.updated_by = user if user is not None and user.is_authenticated else None
        setting.save()
    _prune_endpoint(setting, now=timezone.now())
    logger.info("capture of %s set by %s: %s", endpoint.name, setting.updated_by or "system", fields)
    return setting


def delete_captures(*, endpoint: Endpoint, workload: str | None = None) -> int:
    """Delete the endpoint's captures (one workload's, or all); returns how many."""
    rows = CapturedRequest.objects.filter(endpoint=endpoint)
    if workload is not None:
        rows = rows.filter(workload=workload)
    deleted, _ = rows.delete()
    logger.info("deleted %d captures of %s (%s)", deleted, endpoint.name, workload or "every workload")
    return deleted


# --- retention and size cap ----------------------------------------------------------------------------------


def trim_to_cap(*, endpoint_id: int, max_bytes: int) -> int:
    """Delete the endpoint's oldest captures until the rest fit in max_bytes; returns how many."""
    rows = CapturedRequest.objects.filter(endpoint_id=endpoint_id)
    excess = (rows.aggregate(total=Sum("size_bytes"))["total"] or 0) - max_bytes
    if excess <= 0:
        return 0
    doomed: list[int] = []
    for pk, size in rows.order_by("created_at", "id").values_list("pk", "size_bytes").iterator():
        doomed.append(pk)
        excess -= size
        if excess <= 0:
            break
    deleted = 0
    for start in range(0, len(doomed), 500):  # SQLite's parameter limit
        deleted += CapturedRequest.objects.filter(pk__in=doomed[start : start + 500]).delete()[0]
    return deleted


def _prune_endpoint(setting: CaptureSetting, *, now: datetime) -> int:
    expired = CapturedRequest.objects.filter(
        endpoint_id=setting.endpoint_id, created_at__lt=now - timedelta(days=setting.retention_days)
    )
    deleted, _ = expired.delete()
    return deleted + trim_to_cap(endpoint_id=setting.endpoint_id, max_bytes=setting.max_bytes)


def prune_captures(*, now: datetime | None = None) -> int:
    """Every endpoint's captures past its retention, and its oldest beyond its size cap, deleted; returns how many.
    (An endpoint's captures outlive a setting turned off until their retention; deleting them is an admin's act.)"""
    now = now or timezone.now()
    deleted = 0
    with_captures = CapturedRequest.objects.values("endpoint_id").distinct()
    for setting in CaptureSetting.objects.filter(endpoint_id__in=with_captures):
        deleted += _prune_endpoint(setting, now=now)
    if deleted:
        logger.info("pruned %d captured requests", deleted)
    return deleted


# --- the gateway's batched writes (speculation.services.batched_writer) ---------------------------------------


def _dropped(row: dict[str, Any]) -> None:
    if writer.dropped % 100 == 1:  # one line per 100 under overload, not one per request
        logger.warning("capture queue full (%d): %d captures dropped so far", QUEUE_ROWS, writer.dropped)


def keep_capture(
    *, endpoint_id: int, workload: str, mode: str, prompt_ids: list[int], output_ids: list[int], greedy: bool = False
) -> None:
    """Queue a served request's ids from the gateway (its event loop); written by the flusher, never blocking."""
    writer.put(
        {
            "endpoint_id": endpoint_id,
            "workload": workload,
            "mode": mode,
            "prompt_ids": prompt_ids,
            "output_ids": output_ids,
            "greedy": greedy,
        }
    )


def write_captures(rows: list[dict[str, Any]]) -> int:
    """Seal and insert rows of endpoints whose capture is still on (one query to check, one INSERT), then trim
    those endpoints to their caps. Returns the rows written."""
    caps = dict(
        CaptureSetting.objects.filter(endpoint_id__in={r["endpoint_id"] for r in rows}, enabled=True).values_list(
            "endpoint_id", "max_bytes"
        )
    )
    objects = []
    for row in rows:
        if row["endpoint_id"] not in caps:
            continue
        sealed = crypto.seal(pack(row["prompt_ids"], row["output_ids"]))
        objects.append(
            CapturedRequest(
                endpoint_id=row["endpoint_id"],
                workload=row["workload"][:64],
                mode=row["mode"],
                prompt_tokens=len(row["prompt_ids"]),
                output_tokens=len(row["output_ids"]),
                size_bytes=len(sealed),
                greedy=bool(row.get("greedy")),
                sealed=sealed,
            )
        )
    if not objects:
        return 0
    CapturedRequest.objects.bulk_create(objects)  # created_at: now, within FLUSH_INTERVAL_S of the request's end
    for endpoint_id in {o.endpoint_id for o in objects}:
        trim_to_cap(endpoint_id=endpoint_id, max_bytes=caps[endpoint_id])
    return len(objects)


writer = BatchedWriter(
    what="captures",
    write=write_captures,
    max_rows=lambda: QUEUE_ROWS,
    batch_rows=BATCH_ROWS,
    flush_interval_s=FLUSH_INTERVAL_S,
    on_drop=_dropped,
)
flush = writer.flush
aflush = writer.aflush
queued = writer.queued
