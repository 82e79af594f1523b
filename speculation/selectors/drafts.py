"""Which drafts and training runs a user may see, and which drafts an endpoint may draft with (fleet.permissions)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db.models import QuerySet

from fleet import permissions
from speculation.models import DraftModel, TrainingRun

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

    from fleet.models import Endpoint


def visible_drafts(user: AbstractBaseUser | None) -> QuerySet[DraftModel]:
    return permissions.visible_to(user, DraftModel.objects.all())


def visible_runs(user: AbstractBaseUser | None) -> QuerySet[TrainingRun]:
    return permissions.visible_to(user, TrainingRun.objects.select_related("draft"))


def drafts_usable_by(endpoint: Endpoint) -> QuerySet[DraftModel]:
    """The drafts auto-pairing may measure and apply on an endpoint: what everyone who sees the endpoint (and so its
    pairing table) may see. A team's endpoint: the team's drafts; an owner's own: the drafts its owner may see;
    neither (admins only): every draft. Another tenant's draft is never replayed against an endpoint."""
    if endpoint.team_id is not None:
        return DraftModel.objects.filter(team_id=endpoint.team_id)
    if endpoint.owner_id is not None:
        return visible_drafts(endpoint.owner)
    return DraftModel.objects.all()
