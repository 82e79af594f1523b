"""Print the API token of a user (creating the token, and with --create the user, when missing).

    python manage.py ace_token admin                                 # prints the token key
    python manage.py ace_token ci --create --role viewer --team ml   # user "ci" (no password login), team ml
    python manage.py ace_token ci --endpoint demo --endpoint llama   # the gateway: only these two endpoints
    python manage.py ace_token ci --all-endpoints                    # every endpoint ci can see (the default)
    python manage.py ace_token admin --rotate                        # replaces the token (the old one stops now)

Use it as `Authorization: Token <key>` against /api/v1/, or as the OpenAI client's api_key against /v1/.
A token calls the endpoints its user can see (owned, or owned by one of its teams; admins: all), or the
listed ones among those. A user created here is a viewer unless --role says otherwise.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from rest_framework.authtoken.models import Token

from fleet.models import Endpoint, GatewayTokenScope
from fleet.permissions import ROLES, VIEWER, grant_role


class Command(BaseCommand):
    help = "Create (if needed) and print an API token for a user; optionally set its role, teams and scope."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--create", action="store_true", help="Create the user if it does not exist.")
        parser.add_argument("--rotate", action="store_true", help="Replace an existing token with a new one.")
        parser.add_argument("--role", choices=ROLES, help="Give the user this role (new users: viewer).")
        parser.add_argument("--team", action="append", default=[], help="Add the user to this team (repeatable).")
        scope = parser.add_mutually_exclusive_group()
        scope.add_argument(
            "--endpoint", action="append", default=[], help="Limit the token to this endpoint (repeatable)."
        )
        scope.add_argument("--all-endpoints", action="store_true", help="Let the token call every visible endpoint.")

    def handle(
        self,
        *args,
        username: str,
        create: bool,
        rotate: bool,
        role: str | None,
        team: list[str],
        endpoint: list[str],
        all_endpoints: bool,
        **options,
    ) -> None:
        user_model = get_user_model()
        with transaction.atomic():
            try:
                user = user_model.objects.get(**{user_model.USERNAME_FIELD: username})
            except user_model.DoesNotExist:
                if not create:
                    raise CommandError(f"No user {username!r}: pass --create to create one.") from None
                user = user_model.objects.create_user(**{user_model.USERNAME_FIELD: username})
                user.set_unusable_password()
                user.save()
                role = role or VIEWER
                self.stderr.write(f"created user {username!r} (API only: no password login)")
            if role:
                grant_role(user=user, role=role)
            for name in team:
                if name in ROLES:
                    raise CommandError(f"{name!r} is a role, not a team: use --role.")
                user.groups.add(Group.objects.get_or_create(name=name)[0])
            if rotate:
                Token.objects.filter(user=user).delete()
            token, _ = Token.objects.get_or_create(user=user)
            if endpoint or all_endpoints:
                self._scope(token, endpoint)
        self.stdout.write(token.key)

    def _scope(self, token: Token, names: list[str]) -> None:
        endpoints = list(Endpoint.objects.filter(name__in=names))
        missing = sorted(set(names) - {e.name for e in endpoints})
        if missing:
            raise CommandError(f"No endpoint named {', '.join(map(repr, missing))}.")
        scope, _ = GatewayTokenScope.objects.get_or_create(token=token)
        scope.all_visible = not names
        scope.save(update_fields=["all_visible"])
        scope.endpoints.set(endpoints)
