"""Any write to an endpoint, policy or draft (pages, admin, API, shell) bumps the gateway's routing version."""

from __future__ import annotations

from django.db import transaction
from django.db.models.signals import post_delete, post_save

from speculation.services.version import bump_routing_version


def _bump(**_: object) -> None:
    transaction.on_commit(bump_routing_version)


def connect() -> None:
    from fleet.models import Endpoint
    from speculation.models import DraftModel, SpeculationPolicy

    for model in (Endpoint, SpeculationPolicy, DraftModel):
        post_save.connect(_bump, sender=model, dispatch_uid=f"ace-routing-{model.__name__}-save")
        post_delete.connect(_bump, sender=model, dispatch_uid=f"ace-routing-{model.__name__}-delete")
