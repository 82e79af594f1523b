from django.apps import AppConfig


class ManagedConfig(AppConfig):
    """Managed endpoints: ACE's worker of a node class runs the model server itself (fleet.managed)."""

    name = "fleet.managed"
    label = "managed"
    default_auto_field = "django.db.models.BigAutoField"
