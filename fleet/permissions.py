"""Who may do what, in one place: roles (Django groups carrying permissions) and the object checks.

Roles:
- viewer: reads the endpoints it can see (it owns them, or one of its teams does) and their data.
- operator: a viewer that also registers endpoints, changes modes, policies and probes of the endpoints it
  can see, and registers drafts.
- admin: everything, every endpoint whoever owns it, users and tokens (the Django admin). Superusers are
  admins.

A team is any other Django group; an endpoint, a draft and a training run each belong to an owner and optionally
a team (neither: admins only); only the owner or an admin changes the team. An active user with no role group is a
viewer. What the user cannot see answers 404 (its existence is not revealed); what it can see but not change
answers 403, on the pages, the REST API and the admin alike. An endpoint's captured traffic is its team's admins'
only (`check_captures`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import Q, QuerySet
from django.http import Http404
from rest_framework.permissions import SAFE_METHODS, BasePermission

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser, Group

    from fleet.models import Endpoint

VIEWER, OPERATOR, ADMIN = "viewer", "operator", "admin"
ROLES = (VIEWER, OPERATOR, ADMIN)
OPERATE_PERM = "fleet.operate_endpoint"
MANAGE_ALL_PERM = "fleet.manage_all_endpoints"

_VIEW = [
    "fleet.view_endpoint",
    "fleet.view_probe",
    "speculation.view_draftmodel",
    "speculation.view_speculationpolicy",
    "speculation.view_policychange",
    "speculation.view_stagerecord",
    "speculation.view_trainingrun",
]
_OPERATE = [
    OPERATE_PERM,
    "fleet.add_endpoint",
    "fleet.change_endpoint",
    "fleet.delete_endpoint",
    "speculation.add_draftmodel",
    "speculation.delete_draftmodel",
    "speculation.change_speculationpolicy",
    "speculation.add_trainingrun",
]
ROLE_PERMISSIONS: dict[str, list[str] | None] = {
    VIEWER: _VIEW,
    OPERATOR: _VIEW + _OPERATE,
    ADMIN: None,  # every permission
}


def ensure_roles(**_: object) -> dict[str, Group]:
    """Create the role groups with their permissions (idempotent; run after every migrate)."""
    from django.contrib.auth.models import Group, Permission

    groups: dict[str, Group] = {}
    for role, perms in ROLE_PERMISSIONS.items():
        group, _ = Group.objects.get_or_create(name=role)
        if perms is None:
            wanted = Permission.objects.all()
        else:
            q = Q(pk__in=[])
            for perm in perms:
                app_label, codename = perm.split(".")
                q |= Q(content_type__app_label=app_label, codename=codename)
            wanted = Permission.objects.filter(q)
        group.permissions.add(*wanted)
        groups[role] = group
    return groups


def grant_role(*, user: AbstractBaseUser, role: str) -> None:
    """Give a user exactly one role (admins also get the Django admin: is_staff)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: choose one of {', '.join(ROLES)}")
    with transaction.atomic():
        groups = ensure_roles()
        user.groups.remove(*[g for name, g in groups.items() if name != role])
        user.groups.add(groups[role])
        if role == ADMIN and not user.is_staff:
            user.is_staff = True
            user.save(update_fields=["is_staff"])
    for cache in ("_perm_cache", "_user_perm_cache", "_group_perm_cache", "_ace_role"):
        user.__dict__.pop(cache, None)


def role_of(user: AbstractBaseUser | None) -> str | None:
    """The user's role, or None for anonymous or inactive users (one query, remembered on the user object)."""
    if user is None or not user.is_authenticated or not user.is_active:
        return None
    if user.is_superuser:
        return ADMIN
    cached = user.__dict__.get("_ace_role")
    if cached is not None:
        return cached
    from django.contrib.auth.models import Permission

    # What ModelBackend.has_perm would say for these two permissions, without loading every permission.
    manage_all, operate = MANAGE_ALL_PERM.split(".")[1], OPERATE_PERM.split(".")[1]
    held = set(
        Permission.objects.filter(Q(user=user) | Q(group__user=user), content_type__app_label="fleet")
        .filter(codename__in=(manage_all, operate))
        .values_list("codename", flat=True)
    )
    role = ADMIN if manage_all in held else OPERATOR if operate in held else VIEWER
    user.__dict__["_ace_role"] = role
    return role


def is_admin(user: AbstractBaseUser | None) -> bool:
    return role_of(user) == ADMIN


def can_write(user: AbstractBaseUser | None) -> bool:
    """Operators and admins may write (each within the endpoints it can operate)."""
    return role_of(user) in (OPERATOR, ADMIN)


def visible_to(user: AbstractBaseUser | None, queryset: QuerySet) -> QuerySet:
    """The rows of an owned model (an `owner` and a `team`: endpoints, drafts, training runs) the user may see: all
    for admins; those it or one of its teams owns otherwise (a row with neither: admins only)."""
    role = role_of(user)
    if role is None:
        return queryset.none()
    if role == ADMIN:
        return queryset
    return queryset.filter(Q(owner=user) | Q(team__in=user.groups.all()))


def visible_endpoints(user: AbstractBaseUser | None, queryset: QuerySet[Endpoint] | None = None) -> QuerySet:
    """The endpoints the user may see: all for admins; those it or one of its teams owns otherwise."""
    from fleet.models import Endpoint

    return visible_to(user, queryset if queryset is not None else Endpoint.objects.all())


def can_see(user: AbstractBaseUser | None, obj) -> bool:
    """Whether the user may see an owned object (endpoint, draft, training run)."""
    if role_of(user) == ADMIN:
        return True
    if role_of(user) is None:
        return False
    if obj.owner_id is not None and obj.owner_id == user.pk:
        return True
    return obj.team_id is not None and user.groups.filter(pk=obj.team_id).exists()


def may_change_team(user: AbstractBaseUser | None, obj) -> bool:
    """Only the owner or an admin gives an owned object to another team or to none: a team-mate who operates it
    cannot take it away from the team."""
    return is_admin(user) or (user is not None and obj.owner_id is not None and obj.owner_id == user.pk)


def can_operate(user: AbstractBaseUser | None, endpoint: Endpoint) -> bool:
    """Change its settings, mode, policy, key; probe or delete it."""
    return can_write(user) and can_see(user, endpoint)


def check_endpoint(user: AbstractBaseUser | None, endpoint: Endpoint, *, operate: bool = False) -> Endpoint:
    """The endpoint when the user may see it (and operate it when asked); Http404 / PermissionDenied otherwise."""
    if not can_see(user, endpoint):
        raise Http404("No endpoint matches the given query.")
    if operate and not can_operate(user, endpoint):
        raise PermissionDenied(f"Your role may not change endpoint {endpoint.name!r}.")
    return endpoint


def endpoint_for(user: AbstractBaseUser | None, pk: int, *, operate: bool = False, queryset=None) -> Endpoint:
    """Load an endpoint by id for this user: 404 when it cannot see it, 403 when it may not operate it."""
    from fleet.models import Endpoint

    endpoint = (queryset if queryset is not None else Endpoint.objects.all()).filter(pk=pk).first()
    if endpoint is None:
        raise Http404("No endpoint matches the given query.")
    return check_endpoint(user, endpoint, operate=operate)


def check_captures(user: AbstractBaseUser | None, endpoint: Endpoint) -> Endpoint:
    """The endpoint when the user may see, delete and train on its captured traffic: an admin who owns it or is in
    its team (an endpoint with neither: any admin). Another team's admin, who sees every endpoint, gets a 404 as if
    nothing were captured; a viewer or operator of the team a 403."""
    if not can_see(user, endpoint):
        raise Http404("No endpoint matches the given query.")
    owned = endpoint.owner_id is not None and endpoint.owner_id == user.pk
    in_team = endpoint.team_id is not None and user.groups.filter(pk=endpoint.team_id).exists()
    unowned = endpoint.owner_id is None and endpoint.team_id is None
    if not (owned or in_team or unowned):
        raise Http404("No captured traffic matches the given query.")
    if not is_admin(user):
        raise PermissionDenied("Only admins of the endpoint's team may see, delete or train on its captured traffic.")
    return endpoint


def require_write(user: AbstractBaseUser | None, what: str = "make changes") -> None:
    """PermissionDenied unless the user is an operator or admin."""
    if not can_write(user):
        raise PermissionDenied(f"Your role (viewer) may not {what}: ask an admin for the operator role.")


def teams_for(user: AbstractBaseUser | None) -> QuerySet:
    """The teams the user may give an endpoint: its own (admins: every team); never a role group."""
    from django.contrib.auth.models import Group

    if role_of(user) is None:
        return Group.objects.none()
    teams = Group.objects.all() if is_admin(user) else user.groups.all()
    return teams.exclude(name__in=ROLES).order_by("name")


def check_team(user: AbstractBaseUser | None, team: Group | None, *, current=None) -> None:
    """A team may be given to an endpoint (a draft, a run) by an admin, or by a member of that team; never a role
    group. `current`: the object whose team changes; only its owner or an admin may change it."""
    from django.core.exceptions import ValidationError

    if current is not None and current.team_id != (team.pk if team is not None else None):
        if not may_change_team(user, current):
            raise ValidationError({"team": ["Only the owner or an admin may change the team."]})
    if team is None:
        return
    if team.name in ROLES:
        raise ValidationError({"team": [f"{team.name!r} is a role, not a team."]})
    if not is_admin(user) and not user.groups.filter(pk=team.pk).exists():
        raise ValidationError({"team": [f"You are not a member of team {team.name!r}."]})


class RolePermission(BasePermission):
    """REST default: reads need a signed-in user, writes the operator or admin role (objects checked in views)."""

    message = "Your role (viewer) may only read: writing needs the operator or admin role."

    def has_permission(self, request, view) -> bool:
        if role_of(request.user) is None:
            return False
        return request.method in SAFE_METHODS or can_write(request.user)


class AdminOnly(BasePermission):
    message = "Only admins may do this."

    def has_permission(self, request, view) -> bool:
        return is_admin(request.user)
