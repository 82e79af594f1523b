"""Gateway authentication: an ACE API token (DRF Token), sent the OpenAI way (`Authorization: Bearer ...`).

What a token may do (its user, active or not, and the ids of the endpoints it may call: every endpoint its user
can see (fleet.permissions.visible_endpoints), or a listed subset of those (fleet.models.GatewayTokenScope)) is
read from the database once and kept in this process, keyed by the SHA-256 digest of the token (never the token
itself), so a request pays no database query. An entry is dropped (speculation.gateway.freshness):
- on the next request after any save or delete of a token, scope, user, group, permission or endpoint made
  through Django (ace_token, the admin, the REST API, the pages: signals bump the gateway version, in this
  process at once and in the others through Redis);
- after ACE_GATEWAY_AUTH_TTL seconds (settings.GATEWAY_AUTH_TTL_S, default 5) whatever happened, which bounds
  changes no signal announces (a queryset update(), SQL by hand);
- after 0.25 s while Redis cannot be read.
Unknown tokens are remembered the same way (a flood of bad tokens costs no query each), at most MAX_ENTRIES.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from django.conf import settings
from rest_framework.authtoken.models import Token

from fleet.models import GatewayTokenScope
from fleet.permissions import ADMIN, role_of, visible_endpoints
from speculation.gateway.db import read
from speculation.gateway.freshness import Stamp

MAX_KEY_LEN = 128
MAX_ENTRIES = 10_000


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's user, the endpoint ids it may call (None: every endpoint, an admin's) and the
    user's groups (its teams: a model id resolves among its own and its teams' endpoints first)."""

    user_id: int
    callable_ids: frozenset[int] | None
    team_ids: frozenset[int] = frozenset()

    def may_call(self, endpoint_id: int) -> bool:
        return self.callable_ids is None or endpoint_id in self.callable_ids

    def owns(self, owner_id: int | None, team_id: int | None) -> bool:
        return owner_id == self.user_id or (team_id is not None and team_id in self.team_ids)


def _load(key: str) -> Principal | None:
    # The token with its user and scope in one query, the user's role and groups in two more, and unless it is an
    # admin's unscoped token, the ids it may call in a fourth.
    row = Token.objects.select_related("user", "ace_scope").filter(key=key).first()
    if row is None or not row.user.is_active:
        return None
    try:
        scope = row.ace_scope
    except GatewayTokenScope.DoesNotExist:
        scope = None
    listed = None if scope is None or scope.all_visible else scope.endpoints.values_list("pk", flat=True)
    teams = frozenset(row.user.groups.values_list("pk", flat=True))
    if listed is None and role_of(row.user) == ADMIN:
        return Principal(user_id=row.user.pk, callable_ids=None, team_ids=teams)
    visible = visible_endpoints(row.user)
    if listed is not None:
        visible = visible.filter(pk__in=listed)
    return Principal(user_id=row.user.pk, callable_ids=frozenset(visible.values_list("pk", flat=True)), team_ids=teams)


def _key_from_header(header: str) -> str:
    scheme, _, key = header.partition(" ")
    if scheme.lower() not in ("bearer", "token"):
        return ""
    return key.strip()


_principals: dict[bytes, tuple[Principal | None, Stamp]] = {}


def forget_all() -> None:
    """Drop every remembered token (tests; the version bump does it in the product)."""
    _principals.clear()


async def authenticate(header: str, *, stamp: Stamp) -> Principal | None:
    """The caller the Authorization header belongs to, with the endpoints it may call; None when invalid."""
    key = _key_from_header(header or "")
    if not key or len(key) > MAX_KEY_LEN:
        return None
    digest = hashlib.sha256(key.encode()).digest()
    found = _principals.get(digest)
    if found is not None and stamp.keeps(found[1], max_age_s=settings.GATEWAY_AUTH_TTL_S):
        return found[0]
    principal = await read(_load, key)
    if len(_principals) >= MAX_ENTRIES:
        _principals.clear()
    _principals[digest] = (principal, stamp)
    return principal
