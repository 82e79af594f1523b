"""Print the REST API token of a user (creating the token, and with --create the user, when missing).

    python manage.py ace_token admin            # prints the token key
    python manage.py ace_token ci --create      # creates user "ci" (no password login) if needed
    python manage.py ace_token admin --rotate   # replaces the token with a new one

Use it as `Authorization: Token <key>` against /api/v1/.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from rest_framework.authtoken.models import Token


class Command(BaseCommand):
    help = "Create (if needed) and print a REST API token for a user."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--create", action="store_true", help="Create the user if it does not exist.")
        parser.add_argument("--rotate", action="store_true", help="Replace an existing token with a new one.")

    def handle(self, *args, username: str, create: bool, rotate: bool, **options) -> None:
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
                self.stderr.write(f"created user {username!r} (API only: no password login)")
            if rotate:
                Token.objects.filter(user=user).delete()
            token, _ = Token.objects.get_or_create(user=user)
        self.stdout.write(token.key)
