"""Gateway authentication: an ACE API token (DRF Token), sent the OpenAI way (`Authorization: Bearer ...`).

Valid tokens are cached per process for TOKEN_TTL_S, so a revoked token stops working within that time.
"""

from __future__ import annotations

import time

from asgiref.sync import sync_to_async
from rest_framework.authtoken.models import Token

TOKEN_TTL_S = 10.0
_valid: dict[str, tuple[int, float]] = {}


def _lookup(key: str) -> int | None:
    row = Token.objects.select_related("user").filter(key=key).first()
    if row is None or not row.user.is_active:
        return None
    return row.user_id


def _key_from_header(header: str) -> str:
    scheme, _, key = header.partition(" ")
    if scheme.lower() not in ("bearer", "token"):
        return ""
    return key.strip()


async def authenticate(header: str) -> int | None:
    """The user id the Authorization header belongs to, or None."""
    key = _key_from_header(header or "")
    if not key or len(key) > 128:
        return None
    now = time.monotonic()
    hit = _valid.get(key)
    if hit is not None and now - hit[1] < TOKEN_TTL_S:
        return hit[0]
    user_id = await sync_to_async(_lookup, thread_sensitive=True)(key)
    if user_id is None:
        _valid.pop(key, None)
        return None
    _valid[key] = (user_id, now)
    return user_id
