from django.apps import AppConfig


class SpeculationConfig(AppConfig):
    name = "speculation"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Additive hook (stage): routing-table invalidation for the gateway.
        from speculation import signals

        signals.connect()
