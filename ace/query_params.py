"""Query parameters the database can hold: ids and offsets are 64-bit integers in every backend ACE runs on.

A larger number is a 400 naming the parameter, not an OverflowError from the driver (a 500, found by
`manage.py fuzz_api`)."""

from __future__ import annotations

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination

DB_INT_MAX = 2**63 - 1


def id_param(raw: str, *, name: str) -> int:
    """A positive database id from a query parameter, or a ValidationError on `name`."""
    value = raw.strip()
    if not value.isdigit() or not 0 < int(value) <= DB_INT_MAX:
        raise ValidationError({name: [f"must be an id: a positive integer up to {DB_INT_MAX}"]})
    return int(value)


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    """DRF's limit/offset pagination with the offset kept within a database integer and the limit capped."""

    max_limit = 1000

    def get_offset(self, request) -> int:
        return min(super().get_offset(request), DB_INT_MAX)
