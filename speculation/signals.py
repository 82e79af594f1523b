"""Any write to an endpoint, policy, capture setting or draft, or to who may call them (token, token scope, user,
group, role permissions), from the pages, admin, API or shell, bumps the gateway's version: its cached routes and
tokens are rebuilt on the next request (speculation.services.version)."""

from __future__ import annotations

from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save

from speculation.services.version import bump_routing_version, invalidate_local


def _bump(**_: object) -> None:
    invalidate_local()  # this process: at once (the request that follows may come before the commit)
    transaction.on_commit(bump_routing_version)  # every process, once the change is visible to them


def _user_saved(update_fields: frozenset[str] | None = None, **kwargs: object) -> None:
    if update_fields is not None and set(update_fields) <= {"last_login"}:
        return  # a sign-in changes nobody's access
    _bump(**kwargs)


def _m2m_changed(action: str = "", **kwargs: object) -> None:
    if action.startswith("post_"):
        _bump(**kwargs)


def _endpoint_named(instance: object, **_: object) -> None:
    """This process's metrics label for the endpoint's id is read again (a rename; SQLite reuses a deleted newest
    row's id, which would otherwise count a new endpoint's requests under the old one's name)."""
    from speculation.services.records import forget_name

    forget_name(instance.pk)


def connect() -> None:
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from rest_framework.authtoken.models import Token

    from fleet.models import Endpoint, GatewayTokenScope
    from speculation.models import CaptureSetting, DraftModel, SpeculationPolicy

    post_save.connect(_endpoint_named, sender=Endpoint, dispatch_uid="ace-metrics-label-save")
    post_delete.connect(_endpoint_named, sender=Endpoint, dispatch_uid="ace-metrics-label-delete")
    for model in (Endpoint, SpeculationPolicy, CaptureSetting, DraftModel, Token, GatewayTokenScope, Group):
        post_save.connect(_bump, sender=model, dispatch_uid=f"ace-routing-{model.__name__}-save")
        post_delete.connect(_bump, sender=model, dispatch_uid=f"ace-routing-{model.__name__}-delete")
    user = get_user_model()
    post_save.connect(_user_saved, sender=user, dispatch_uid="ace-routing-user-save")
    post_delete.connect(_bump, sender=user, dispatch_uid="ace-routing-user-delete")
    for through in (
        user.groups.through,
        user.user_permissions.through,
        Group.permissions.through,
        GatewayTokenScope.endpoints.through,
    ):
        m2m_changed.connect(_m2m_changed, sender=through, dispatch_uid=f"ace-routing-{through.__name__}")
