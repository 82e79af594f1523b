from django.apps import AppConfig
from django.db.models.signals import post_migrate


class FleetConfig(AppConfig):
    name = "fleet"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # After every migrate (and test database flush), for every app, after its permissions were created:
        # the role groups exist and carry every permission they should.
        post_migrate.connect(_ensure_roles, dispatch_uid="ace-ensure-roles")


def _ensure_roles(sender: AppConfig, **kwargs: object) -> None:
    from fleet.permissions import ensure_roles

    ensure_roles()
