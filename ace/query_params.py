"""Query parameters the database can hold: ids and offsets are 64-bit integers in every backend ACE runs on.

A larger number is a 400 naming the parameter, not an OverflowError from the driver (a 500, found by
`manage.py fuzz_api`). Only ASCII digits make an id: str.isdigit() also accepts "²" and "①" (which int() then
refuses: a 500) and int() reads "１" and "٣" as numbers."""

from __future__ import annotations

import math
from datetime import datetime

from django.utils.dateparse import parse_datetime
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination

DB_INT_MAX = 2**63 - 1


def is_ascii_digits(value: str) -> bool:
    """True for a non-empty run of 0-9 only (what int() reads the same in every locale and script)."""
    return value.isascii() and value.isdigit()


def id_param(raw: str, *, name: str) -> int:
    """A positive database id from a query parameter, or a ValidationError on `name`."""
    value = raw.strip()
    if not is_ascii_digits(value) or not 0 < int(value) <= DB_INT_MAX:
        raise ValidationError({name: [f"must be an id: a positive integer up to {DB_INT_MAX}"]})
    return int(value)


def datetime_param(raw: str, *, name: str) -> datetime:
    """An ISO 8601 datetime from a query parameter, or a ValidationError on `name`: also for one that reads like a
    date but is none (month 13, day 45: parse_datetime raises ValueError there)."""
    try:
        moment = parse_datetime(raw.strip())
    except ValueError:
        moment = None
    if moment is None:
        raise ValidationError({name: ["must be an ISO 8601 datetime with a time zone, e.g. 2026-01-31T12:00:00Z"]})
    return moment


def finite_number(raw: str) -> float | None:
    """The number `raw` writes, or None: float() also reads "nan" and "inf", which no computation here means and
    JSON cannot carry (DRF's renderer raises on them: a 500)."""
    try:
        value = float(raw.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def number_param(raw: str, *, name: str) -> float:
    """A finite number from a query parameter, or a ValidationError on `name`."""
    value = finite_number(raw)
    if value is None:
        raise ValidationError({name: ["must be a finite number"]})
    return value


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    """DRF's limit/offset pagination with the offset kept within a database integer and the limit capped."""

    max_limit = 1000

    def get_offset(self, request) -> int:
        return min(super().get_offset(request), DB_INT_MAX)
