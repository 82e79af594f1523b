"""Users with a role and teams, and clients signed in as them (REST by token, pages by session)."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet.permissions import grant_role


def make_user(name: str, role: str | None, *, teams: tuple[str, ...] = ()):
    user = get_user_model().objects.create_user(username=name, password="pw-for-tests-only")
    if role is not None:
        grant_role(user=user, role=role)
    for team in teams:
        user.groups.add(Group.objects.get_or_create(name=team)[0])
    return user


def api_as(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    return client


def browser_as(user) -> Client:
    client = Client()
    client.force_login(user)
    return client
