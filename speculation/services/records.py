"""Stage records: one row per request the speculative_decoding stage saw (never for off mode).

The gateway writes behind the request, in batches (`keep_record`, on speculation.services.batched_writer): a
record is queued and the response goes on; it is written within FLUSH_INTERVAL_S, or at once when BATCH_ROWS wait,
with one INSERT per batch. Under overload (settings.RECORD_QUEUE_ROWS waiting) a record is dropped rather than
anyone waiting, and counted in ace_stage_records_dropped_total; its request still counts in the other metrics. What
is queued is written on shutdown and whenever `flush` / `aflush` is called (tests, benches).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, OperationalError, connections, transaction
from django.utils import timezone

from fleet.models import Endpoint
from speculation.models import StageRecord
from speculation.selectors import metrics
from speculation.services.batched_writer import BatchedWriter

logger = logging.getLogger(__name__)

_FIELDS = {f.attname for f in StageRecord._meta.concrete_fields if f.name not in ("id", "created_at")}

# Cost: one INSERT of 500 rows takes about as much CPU as 10 single-row ones; 0.5 s keeps a record's delay short.
BATCH_ROWS = 500
FLUSH_INTERVAL_S = 0.5
WRITE_ATTEMPTS = 4


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


def _observe(row: dict[str, Any], label: str) -> None:
    metrics.observe_record(endpoint=label, mode=row["mode"], action=row["action"], fields=row)


def record_stage(*, endpoint_id: int, request_id: str, mode: str, action: str, **fields: Any) -> StageRecord:
    """Write one record now (the worker's shadow measurements)."""
    record = StageRecord.objects.create(
        endpoint_id=endpoint_id, request_id=request_id, mode=mode, action=action, **_clean(fields)
    )
    metrics.observe_record(endpoint=_endpoint_label(endpoint_id), mode=mode, action=action, fields=fields)
    return record


def write_batch(rows: list[dict[str, Any]]) -> int:
    """Write rows in one transaction, retried while the database is busy; a batch that fails otherwise is written
    row by row, so that one bad row costs only its own record (logged with its request id). Every row counts in the
    metrics, a failed one in ace_stage_record_write_failures too. Returns the rows written."""
    written = _write(rows)
    for row, ok in zip(rows, written, strict=True):
        if not ok:
            metrics.RECORD_WRITE_FAILURES.inc()
        _observe(row, _endpoint_label(row["endpoint_id"]))
    return sum(written)


def _write(rows: list[dict[str, Any]]) -> list[bool]:
    for attempt in range(WRITE_ATTEMPTS):
        try:
            _insert(rows)
            return [True] * len(rows)
        except OperationalError:
            if attempt == WRITE_ATTEMPTS - 1:
                for row in rows:
                    logger.exception("stage record for request %s (%s/%s) not written", *_what(row))
                return [False] * len(rows)
            time.sleep(0.05 * 2**attempt)
        except Exception:  # noqa: BLE001 - a record must never break a response; it is logged with the request id
            if len(rows) > 1:
                return [_write([row])[0] for row in rows]
            logger.exception("stage record for request %s (%s/%s) could not be written", *_what(rows[0]))
            return [False]
    return [False] * len(rows)


def _what(row: dict[str, Any]) -> tuple[str, str, str]:
    return row["request_id"], row["mode"], row["action"]


def _insert(rows: list[dict[str, Any]]) -> None:
    """One INSERT executed for every row (executemany): Django's bulk_create prepares each value through its field
    and splits the rows into batches of SQLite's parameter limit, about 200 us of CPU per record; this is 10-20."""
    db = connections[DEFAULT_DB_ALIAS]  # looked up once per batch: the proxy `connection` costs a lookup per use
    with transaction.atomic(), db.cursor() as cursor:
        cursor.executemany(_insert_sql(db), [_params(row, db) for row in rows])


_COLUMNS = [f for f in StageRecord._meta.concrete_fields if f.name != "id"]
_DEFAULTS = {f.attname: f.get_default() for f in _COLUMNS}
_PREPARED = {f.attname: f for f in _COLUMNS if f.get_internal_type() in ("JSONField", "DateTimeField")}


def _insert_sql(db: Any) -> str:
    quote = db.ops.quote_name
    names = ", ".join(quote(f.column) for f in _COLUMNS)
    marks = ", ".join(["%s"] * len(_COLUMNS))
    return f"INSERT INTO {quote(StageRecord._meta.db_table)} ({names}) VALUES ({marks})"


def _params(row: dict[str, Any], db: Any) -> list[Any]:
    if "endpoint_id" not in row:
        raise ValueError("a stage record names its endpoint")
    values = []
    for field in _COLUMNS:
        name = field.attname
        value = row.get(name, _DEFAULTS[name])
        if value is None and name == "created_at":
            value = timezone.now()
        if name in _PREPARED:
            value = _PREPARED[name].get_db_prep_save(value, db)
        values.append(value)
    return values


async def arecord_stage(*, endpoint_id: int, request_id: str, mode: str, action: str, **fields: Any) -> None:
    """Write one record now, from async code (a failed write is logged and counted, never raised)."""
    row = dict(endpoint_id=endpoint_id, request_id=request_id, mode=mode, action=action, **_clean(fields))
    row["created_at"] = timezone.now()
    await sync_to_async(write_batch, thread_sensitive=True)([row])


# --- the gateway's batched writes (speculation.services.batched_writer) ---------------------------------------


def _dropped(row: dict[str, Any]) -> None:
    metrics.RECORDS_DROPPED.inc()
    _observe(row, _cached_name(row["endpoint_id"]) or str(row["endpoint_id"]))


writer = BatchedWriter(
    what="stage records",
    write=write_batch,
    max_rows=lambda: settings.RECORD_QUEUE_ROWS,
    batch_rows=BATCH_ROWS,
    flush_interval_s=FLUSH_INTERVAL_S,
    on_drop=_dropped,
)
flush = writer.flush
aflush = writer.aflush
queued = writer.queued


def keep_record(**fields: Any) -> None:
    """Queue a record from the gateway; it is written by the flusher, never by the request (a client that
    disconnects right after the last byte does not lose it). Never blocks: a full queue drops it (counted)."""
    row = _clean(fields)
    row["created_at"] = timezone.now()  # when the request ended, not when its batch is written
    writer.put(row)
