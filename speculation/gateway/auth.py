"""Gateway authentication: an ACE API token (DRF Token), sent the OpenAI way (`Authorization: Bearer ...`).

Every request looks the token up in the database (one small query batch, no cache), so a revoked token, a
deactivated user or a narrowed scope takes effect on the very next request. The token's scope says which
endpoints it may call: every endpoint its user can see (fleet.permissions.visible_endpoints), or a listed
subset of those (fleet.models.GatewayTokenScope).
"""

from __future__ import annotations

from dataclasses import dataclass

from asgiref.sync import sync_to_async
from rest_framework.authtoken.models import Token

from fleet.models import GatewayTokenScope
from fleet.permissions import visible_endpoints

MAX_KEY_LEN = 128


@dataclass(frozen=True)
class Principal:
    """Who is calling, and the ids of the endpoints this token may call."""

    user_id: int
    endpoint_ids: frozenset[int]

    def may_call(self, endpoint_id: int) -> bool:
        return endpoint_id in self.endpoint_ids


def _lookup(key: str) -> Principal | None:
    # Three small queries: the token with its user and scope, the user's role, the endpoint ids it may call.
    row = Token.objects.select_related("user", "ace_scope").filter(key=key).first()
    if row is None or not row.user.is_active:
        return None
    visible = visible_endpoints(row.user)
    try:
        scope = row.ace_scope
    except GatewayTokenScope.DoesNotExist:
        scope = None
    if scope is not None and not scope.all_visible:
        visible = visible.filter(pk__in=scope.endpoints.values("pk"))
    return Principal(user_id=row.user_id, endpoint_ids=frozenset(visible.values_list("pk", flat=True)))


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
