"""Gateway authentication: an ACE API token (DRF Token), sent the OpenAI way (`Authorization: Bearer ...`).

Every request looks the token up in the database (one small query batch, no cache), so a revoked token, a
deactivated user or a narrowed scope takes effect on the very next request. The token's scope says which
endpoints it may call: every endpoint its user can see (fleet.permissions.visible_endpoints), or a listed
subset of those (fleet.models.GatewayTokenScope).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.db.models import QuerySet
from rest_framework.authtoken.models import Token

from fleet.models import GatewayTokenScope
from fleet.permissions import role_of, visible_endpoints

MAX_KEY_LEN = 128


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's user and, for a token scoped to a list, the listed endpoint ids."""

    user: Any
    scoped_ids: frozenset[int] | None  # None: every endpoint the user can see

    def _callable(self) -> QuerySet:
        visible = visible_endpoints(self.user)
        return visible if self.scoped_ids is None else visible.filter(pk__in=self.scoped_ids)

    async def may_call(self, endpoint_id: int) -> bool:
        """One small query for the endpoint this request names (never the list of every callable endpoint)."""
        return await self._callable().filter(pk=endpoint_id).aexists()

    async def callable_ids(self) -> frozenset[int]:
        """Every endpoint id this token may call (for /v1/models)."""
        return frozenset([pk async for pk in self._callable().values_list("pk", flat=True)])


def _lookup(key: str) -> Principal | None:
    # The token with its user and scope in one query; the user's role is read (and remembered on the user) here
    # too, so the per-request check afterwards is one EXISTS.
    row = Token.objects.select_related("user", "ace_scope").filter(key=key).first()
    if row is None or not row.user.is_active:
        return None
    role_of(row.user)
    try:
        scope = row.ace_scope
    except GatewayTokenScope.DoesNotExist:
        scope = None
    scoped = None if scope is None or scope.all_visible else frozenset(scope.endpoints.values_list("pk", flat=True))
    return Principal(user=row.user, scoped_ids=scoped)


def _key_from_header(header: str) -> str:
    scheme, _, key = header.partition(" ")
    if scheme.lower() not in ("bearer", "token"):
        return ""
    return key.strip()


async def authenticate(header: str) -> Principal | None:
    """The caller the Authorization header belongs to, with the endpoints it may call; None when invalid."""
    key = _key_from_header(header or "")
    if not key or len(key) > MAX_KEY_LEN:
        return None
    return await sync_to_async(_lookup, thread_sensitive=True)(key)
